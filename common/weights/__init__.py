"""The weights contract (docs/design.md §6): versions of the policy's state dict in Redis,
chunked, checksummed and verified end to end. What both sides share lives here:

- ``format``: errors, the full-weights digest, the finite check, safetensors written and read
  without a second copy of the state;
- ``deltas``: sparse, bit-exact deltas between two versions;
- ``manifest``: what a stored version holds and how its chunks are checksummed;
- ``keys``: the Redis key names;
- ``store``: ``WeightStore``, a run's settings and the read-only queries (latest version,
  manifest), the base of the learner's ``learner.weight_writer.WeightWriter`` (publish,
  retention) and the actors' ``actors.weight_reader.WeightReader`` (fetch, host cache);
- ``connection``: rebuilding a Redis connection in another process, retrying through outages.

Deltas (``keyframe_every > 1``): a version is either a *full* version (a keyframe) or a sparse
*delta* against the version before it. The manifest of every version carries ``weights_sha256``,
a digest of the full resulting weights: a reader that applied deltas checks it, so a wrong,
tampered or missing delta is refused, never loaded. A reader holding the delta's base applies
it; any other walks back to the chain's keyframe (retention keeps every version from the
keyframe of the oldest retained version on). Every reader refuses non-finite floating tensors
(after decoding, and after applying a delta), and the writer refuses to write them.
"""
