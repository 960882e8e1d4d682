"""The vLLM engine: :class:`~.engine.VllmEngine` drives an in-process ``vllm.LLM`` behind the torch
engine's interface. Beside it: the start-up checks and options (:mod:`.setup`), the probe of the
vLLM internals it relies on (:mod:`.compat`), the samples of a call and their verification across
swaps (:mod:`.slot`, :mod:`.verify`), and vLLM's native EAGLE-3 (:mod:`.eagle`); the code vLLM
itself loads by path and calls inside its worker is in :mod:`.plugins`."""
