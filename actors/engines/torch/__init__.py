"""The torch engine, on the repository's own transformer: :class:`~.engine.TorchEngine` admits,
retires and delivers rows; it owns the state its parts share (:mod:`.rows`), the decoding step
(:mod:`.decode`, with the EAGLE-3 head's steps in :mod:`.eagle`) and the weight swaps applied to
rollouts in flight (:mod:`.swap`)."""
