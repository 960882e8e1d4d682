"""The decoding kernel both engines share: the rejection sampler (``sampler``), the drafters (one
file each: ``early_exit``, ``eagle``, ``ngram``), the adaptive draft length (``draft_length``),
the paged KV cache (``paged_cache``) and delayed verification of tokens in flight
(``inflight``)."""
