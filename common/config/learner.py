"""Config section of the learner: transport, optimisation, publishing, checkpoints, limits."""

from __future__ import annotations

from dataclasses import dataclass

from common.config.checks import (
    check_port,
    require,
    require_at_least,
    require_choice,
    require_positive,
)
from common.config.field_types import (
    CheckpointFormat,
    LearnerProfile,
    LossAggregation,
    LrSchedule,
    ModelImpl,
    OverlongMode,
    Precision,
    PublishDtype,
    PublishUpload,
    RatioLevel,
)
from common.config.modes import (
    CHECKPOINT_FORMATS,
    LEARNER_PROFILES,
    LOSS_AGGREGATIONS,
    LR_SCHEDULES,
    MODEL_IMPLS,
    OVERLONG_MODES,
    PRECISIONS,
    PUBLISH_DTYPES,
    PUBLISH_UPLOADS,
    RATIO_LEVELS,
)
from common.config.run import is_loopback_host

WEIGHTS_GROUP_ON_CUDA = (
    "the weights group on CUDA (NCCL) has not been run on a GPU yet and is refused, for three "
    "reasons: an actor would receive each whole version into GPU memory beside vLLM's share "
    "(14.2 GiB at 7B in bfloat16: out of memory); the group's timeout is its 10 s connect "
    "timeout and PyTorch's NCCL watchdog tears the process down when a collective fails, so a "
    "member that dies or pauses would kill learner rank 0; and its address defaults to "
    "127.0.0.1, which another container cannot reach. Leave learner.weights_group and "
    "actor.weights_group off: versions then go through the Redis weight store, the supported "
    "path (docs/deployment.md); the group itself runs on CPU (gloo)"
)


def weights_group_refusal(device: object = "cpu", backend: str = "") -> str | None:
    """Why the weights group may not run on ``device`` (a torch device or its description:
    ``cpu``, ``cuda``, ``cuda:1``) or over ``backend`` (``gloo``, ``nccl``); None where it may.
    CUDA, where the group would use NCCL, is refused until a GPU has run it."""
    kind = str(device).strip().lower().partition(":")[0]
    if kind == "cuda" or backend.strip().lower() == "nccl":
        return WEIGHTS_GROUP_ON_CUDA
    return None


@dataclass
class LearnerConfig:
    address: str = "tcp://127.0.0.1:5555"
    """Where actors connect (the learner's reachable address)."""
    bind: str = ""
    """Where the learner binds; empty: same as ``address``. Use ``tcp://0.0.0.0:5555`` to accept
    actors on other machines (loopback only by default)."""
    lr: float = 3e-4
    """AdamW learning rate. On CUDA with a real model the GPU profile picks one in the range RL
    recipes use at the model's size (``common/config/gpu_profile.py``; 1e-6 at 7B) and refuses
    one far above that range."""
    lr_warmup_steps: int = 0
    """Linear warm-up of the policy's learning rate over the first N steps (0 or 1: none)."""
    lr_schedule: LrSchedule = "constant"
    """The policy's learning rate after the warm-up: ``constant``, or a ``linear`` or ``cosine``
    decay from ``learner.lr`` to ``lr * lr_min_ratio`` at the run's last step (``run.steps``)."""
    lr_min_ratio: float = 0.0
    """Floor of the ``linear`` and ``cosine`` decays, as a share of ``learner.lr`` (in [0, 1])."""
    allow_unusual_lr: bool = False
    """Run with a ``learner.lr`` far above the range RL recipes use at the model's size (which
    the GPU profile otherwise refuses at start), with a warning."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = off)."""
    groups_per_step: int = 16
    """Trajectory groups consumed per optimizer step."""
    max_staleness: int = 2
    """Groups with ``learner_version - group.version`` above this are dropped (and counted)."""
    max_staleness_from_lag: int = 0
    """0: the bound is ``max_staleness``. N > 0: it follows the measured weight-delivery lag, the
    versions the learner has published that the slowest live actor did not hold at its last
    batch (the most over the last 8 steps), plus one: never below ``max_staleness``, at most N.
    Groups generated under weights still on their way are then trained (with ``tis_cap``
    against their staleness), not dropped. The GPU profile sets 8 (not with
    ``max_staleness=0``: on-policy runs wait for each version)."""
    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]. With
    ``ratio_level=sequence`` (GSPO) the ratio is a sequence's, and GSPO uses far smaller values
    (3e-4 below, 4e-4 above)."""
    clip_eps_high: float = 0.0
    """Upper clip of the ratio (clip-higher, DAPO: 0.28 with clip_eps 0.2); 0: ``clip_eps``."""
    ratio_level: RatioLevel = "token"
    """``token``: one importance ratio per token; ``sequence`` (GSPO): one per sequence,
    ``exp(mean over its tokens of log pi_theta - log pi_behaviour)``, clipped per sequence."""
    loss_agg: LossAggregation = "token_mean"
    """How token terms become the loss: ``token_mean`` over the batch's completion tokens,
    ``seq_mean`` (mean over each sequence, then over sequences) or ``seq_sum`` (sum over tokens /
    (sequences x ``loss_agg_tokens``), Dr.GRPO)."""
    loss_agg_tokens: int = 0
    """The constant length of ``loss_agg=seq_sum``; 0: the task's ``max_new_tokens``."""
    adv_std_norm: bool = True
    """Divide each group's centred rewards by the group's standard deviation (GRPO); false:
    centred rewards only (Dr.GRPO)."""
    tis_cap: float = 0.0
    """Truncated importance sampling: cap C (> 1) on a token's importance weight to the
    behaviour policy, gradient kept (``learner/loss.py``); 0: off."""
    dynamic_sampling: bool = False
    """Skip groups whose rewards are all equal (no signal; counted in
    ``learner/groups_skipped_no_signal``) and fill the step from the next groups (DAPO)."""
    overlong: OverlongMode = "none"
    """Completions that hit the length limit: ``none``; ``mask`` (left out of the loss);
    ``penalty`` (DAPO's soft penalty on every completion's reward, by its length)."""
    overlong_buffer: int = 0
    """``overlong=penalty``: the last N tokens before ``max_new_tokens`` in which the penalty
    rises linearly from 0 to ``overlong_penalty``; 0: a quarter of ``max_new_tokens``."""
    overlong_penalty: float = 1.0
    """``overlong=penalty``: the largest penalty (subtracted from the reward at the limit)."""
    dual_clip: float = 3.0
    """Dual-clip bound c: for negative advantages the surrogate is bounded below by c * A, which
    truncates importance ratios pi_theta / pi_behaviour above c (stale-token correction)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the initial (reference) policy; 0 keeps no reference copy."""
    publish_every: int = 1
    """Publish a new weights version every N optimizer steps."""
    publish_dtype: PublishDtype = ""
    """dtype of published weights (``bfloat16``, ``float16``, ``float32``); empty: the training
    dtype (the parameters'). Recorded in the manifest."""
    publish_max_inflight: int = 1
    """Versions snapshotted but not yet uploaded; the upload runs in the background while the
    next step trains, and the learner waits only when this many are in flight (never with
    ``publish_latest_wins``). 0: publish synchronously on the learner's thread."""
    publish_latest_wins: bool = True
    """When ``publish_max_inflight`` versions are already in flight, a new version waits in one
    more snapshot instead of the learner waiting, and a newer one replaces it before its upload
    starts: a slow upload skips versions (``learner/publish_skipped_versions``) and actors get
    the newest. False: every version is uploaded, the learner waiting for room."""
    publish_upload: PublishUpload = "process"
    """Where background uploads run: ``process`` (a child process reading the snapshot from
    shared memory: serializing never takes the learner's GIL; needs ``/dev/shm`` room for
    ``publish_max_inflight`` copies of the weights, one more with ``publish_latest_wins``) or
    ``thread`` (a thread of the learner)."""
    weights_group: bool = False
    """Also broadcast each published version to the actors that join the learner's weights group
    (``common/weights/publish/collective_sender.py``; gloo, on CPU only: a learner on CUDA, where the group
    would use NCCL, refuses to start with it until a GPU has run that path), in bfloat16; Redis
    keeps the manifests and serves the actors outside the group."""
    weights_group_address: str = "127.0.0.1:29650"
    """``HOST:PORT`` of the weights group's rendezvous store: the learner hosts it, listening on
    that host only, and actors with ``actor.weights_group`` join it. A host that is not loopback
    (for actors on other machines) needs ``weights_group_allow_remote``."""
    weights_group_allow_remote: bool = False
    """Let the weights group's store listen on a host that is not loopback. The store and the
    broadcasts are not encrypted, and anyone who reaches the store can read and write its keys
    (joins are still admitted only with a proof of the run's secret, kept in Redis): use it on a
    network you trust only."""
    weights_group_bucket_mb: int = 256
    """MiB of a version broadcast at a time."""
    weights_group_timeout_s: float = 60.0
    """Longest one broadcast may take before its epoch of the group is given up (the members
    join again)."""
    checkpoint_every: int = 50
    """Write a checkpoint every N steps (and always at exit)."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory when one exists."""
    checkpoint_format: CheckpointFormat = "auto"
    """With several learner ranks: ``sharded``, each rank writes its own rows of the model and
    AdamW state (``torch.distributed.checkpoint``; no full-state gather; consolidated for HF tools
    with ``python -m learner.checkpoint_sharded``), or ``full``, gathered to rank 0 and written in
    HF format. ``auto``: sharded. One process always writes ``full``."""
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
    """Largest trajectory frame the learner's socket reads; a larger one closes its connection
    (counted in ``connections_closed``). A frame over twice what a valid group of this run can be
    (group size x context) is read, refused by its length before it is decoded, and counted as
    ``oversize``."""
    recv_buffer_bytes: int = 64 * 1024 * 1024
    """Bytes of valid frames queued per actor connection before the learner's socket stops
    reading it (the receive high-water mark is this over what a valid frame of this run can be,
    between 2 and 64 frames; ``learner/wiring.py`` ``build_receiver``)."""
    model_impl: ModelImpl = "auto"
    """Which implementation trains the policy: ``builtin`` (``common.model.Transformer``: Llama,
    Qwen2, Qwen3 layouts), ``hf`` (``transformers.AutoModelForCausalLM``) or ``auto`` (built-in
    when it computes the checkpoint's architecture, else ``transformers``)."""
    precision: Precision = "fp32"
    """``fp32``; ``bf16-mixed``: bf16 autocast compute, fp32 master weights, gradients and AdamW
    state (16 bytes/parameter); ``bf16``: bf16 weights, gradients and AdamW state (8
    bytes/parameter, lossy updates: small steps round away). On a CPU without bf16 matrix
    instructions (no AVX512-BF16 or AMX) ``bf16-mixed`` and ``bf16`` become ``fp32`` with a
    warning unless named on the command line (``common/cpu_precision.py``)."""
    max_tokens_per_microbatch: int = 0
    """Token budget of one forward/backward (rows x their longest row); the step accumulates
    gradients over as many micro-batches as the batch needs, with the one-batch update. 0: the
    whole batch (of this rank) at once."""
    logprob_chunk_tokens: int = 1024
    """Completion positions whose [chunk, vocab] logits exist at a time (recomputed in backward);
    0: all completion positions of a micro-batch at once."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""
    profile: LearnerProfile = "auto"
    """The four settings above against the device's memory, estimated at start from the model's
    config with ``specrl plan``'s formulas (``common/config/memory_fit.py``). ``auto``: kept when they
    fit, else those still at their defaults become more frugal (a micro-batch budget,
    bf16-mixed, activation checkpointing, smaller budgets and log-prob chunks) until they fit;
    ``manual``: as given. Both refuse to start, with the estimate, when nothing fits. ``off``:
    no estimate, no check."""
    device_memory_gib: float = 0.0
    """Memory per device the fit check plans against, in GiB; 0: measured (free GPU memory, or
    the host's available RAM over the learner ranks on it). Set it to plan for another machine."""

    def __post_init__(self) -> None:
        require_choice("learner.model_impl", self.model_impl, MODEL_IMPLS)
        require_choice("learner.precision", self.precision, PRECISIONS)
        require_choice("learner.publish_upload", self.publish_upload, PUBLISH_UPLOADS)
        require_choice("learner.profile", self.profile, LEARNER_PROFILES)
        require_choice("learner.checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        self._check_algorithm()
        require(
            self.publish_dtype in PUBLISH_DTYPES,
            f"learner.publish_dtype must be '', bfloat16, float16 or float32, got "
            f"{self.publish_dtype!r}",
        )
        require(
            self.max_seq_tokens >= 0,
            f"learner.max_seq_tokens must be >= 0 (0 = model context), got {self.max_seq_tokens}",
        )
        require_at_least("learner", self, max_frame_bytes=4096, recv_buffer_bytes=4096)
        require_at_least("learner", self, groups_per_step=1, publish_every=1, checkpoint_every=1)
        require_at_least("learner", self, queue_max=1, metrics_every=1)
        require_at_least("learner", self, publish_max_inflight=0, max_staleness=0, kl_coef=0)
        lag_cap = self.max_staleness_from_lag
        require(
            lag_cap == 0 or (self.max_staleness > 0 and lag_cap >= self.max_staleness),
            "learner.max_staleness_from_lag must be 0 (off) or at least learner.max_staleness "
            f"(its floor), and needs max_staleness > 0 (on-policy runs wait for each version), "
            f"got {lag_cap} with max_staleness={self.max_staleness}",
        )
        require_at_least("learner", self, max_tokens_per_microbatch=0, logprob_chunk_tokens=0)
        require_at_least("learner", self, device_memory_gib=0, lr_warmup_steps=0)
        require_positive("learner", self, "lr", "max_abs_reward", "group_timeout_s")
        require(0 < self.clip_eps < 1, f"learner.clip_eps must be in (0, 1), got {self.clip_eps}")
        require(self.dual_clip > 1, f"learner.dual_clip must be > 1, got {self.dual_clip}")
        require(
            self.address.startswith(("tcp://", "ipc://")),
            f"learner.address must be tcp://HOST:PORT or ipc://PATH, got {self.address!r}",
        )
        check_port("learner.metrics_port", self.metrics_port)
        host, _, port = self.weights_group_address.rpartition(":")
        require(
            bool(host) and port.isdigit() and 0 < int(port) < 65536,
            f"learner.weights_group_address must be HOST:PORT, got {self.weights_group_address!r}",
        )
        require(
            not self.weights_group or self.weights_group_allow_remote or is_loopback_host(host),
            f"learner.weights_group_address {self.weights_group_address!r} is not a loopback "
            "host: the weights group's store and broadcasts are not encrypted; set "
            "learner.weights_group_allow_remote=true to serve actors over a network you trust",
        )
        require_at_least("learner", self, weights_group_bucket_mb=1)
        require_positive("learner", self, "weights_group_timeout_s")

    def _check_algorithm(self) -> None:
        """The algorithm options (docs/configuration.md, Algorithms)."""
        require_choice("learner.loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        require_choice("learner.ratio_level", self.ratio_level, RATIO_LEVELS)
        require_choice("learner.overlong", self.overlong, OVERLONG_MODES)
        require_choice("learner.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        require_at_least("learner", self, clip_eps_high=0, loss_agg_tokens=0, overlong_buffer=0)
        require_at_least("learner", self, overlong_penalty=0)
        require(
            0 <= self.lr_min_ratio <= 1,
            f"learner.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}",
        )
        require(
            self.tis_cap == 0 or self.tis_cap > 1,
            f"learner.tis_cap must be 0 (off) or > 1, got {self.tis_cap}",
        )

    @property
    def clip_high(self) -> float:
        """The upper clip of the ratio: ``clip_eps_high``, or ``clip_eps`` when that is 0."""
        return self.clip_eps_high or self.clip_eps

    def resolved_bind(self) -> str:
        return self.bind or self.address
