"""The weights contract (docs/design.md §6): versions of the policy's state dict in Redis,
chunked, checksummed and verified end to end. What both sides share lives here:

- ``format``: errors, the full-weights digest, the finite check, safetensors written and read
  without a second copy of the state;
- ``deltas``: applying a sparse, bit-exact delta between two versions;
- ``manifest``: what a stored version holds and how its chunks are checksummed;
- ``keys``: the Redis key names;
- ``store``: ``WeightStore``, a run's settings and the read-only queries (latest version,
  manifest), the base of the learner's ``common.weights.publish.writer.WeightWriter`` (publish,
  retention) and the actors' ``common.weights.fetch.reader.WeightReader`` (fetch, host cache);
- ``connection``: rebuilding a Redis connection in another process, retrying through outages.

Deltas, keyframes and the digest that lets a reader refuse a wrong delta: docs/design.md §6.3.
"""
