"""Config sections every process reads: the run, the model, the task, Redis, sampling, security."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from common.config.checks import require, require_at_least, require_choice, require_ordered
from common.config.field_types import (
    ChatTemplateMode,
    DatasetFormat,
    RewardFailureMode,
    TaskName,
)
from common.config.modes import (
    CHAT_TEMPLATE_MODES,
    DATASET_FORMATS,
    DATASET_SUFFIXES,
    DATASET_TASKS,
    REWARD_FAILURE_MODES,
    TASK_NAMES,
)
from common.heap import MMAP_THRESHOLD_MAX

logger = logging.getLogger(__name__)

REDIS_PASSWORD_ENV = "SPECRL_REDIS_PASSWORD"
"""Environment variable holding the Redis password: read by every process that connects, so the
password never travels on a command line (``/proc/*/cmdline`` is readable by every local user);
a password inside ``redis.url`` wins over it."""
REDACTED = "***"


def split_redis_password(url: str) -> tuple[str, str]:
    """``url`` without its password, and the password (URL-unquoted; "" when there is none).
    A user name stays in the URL."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, ""
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


def _put_password(url: str, quoted: str) -> str:
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quoted}@{host}"))


def with_redis_password(url: str, password: str) -> str:
    """``url`` with ``password`` put in (quoted), replacing any it had."""
    bare, _ = split_redis_password(url)
    return _put_password(bare, quote(password, safe="")) if password else bare


def redact_redis_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for files and logs)."""
    bare, password = split_redis_password(url)
    return _put_password(bare, REDACTED) if password else url


def is_loopback_host(host: str | None) -> bool:
    """Whether ``host`` names this machine only: ``localhost`` or a loopback IP literal
    (``[::1]`` too); any other name, or none, counts as not loopback (it is not resolved here)."""
    host = (host or "").strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redis_exposure_warnings(url: str, env_password: str = "") -> list[str]:
    """What is unprotected about reaching Redis at ``url`` from another machine: no password
    (neither in the URL nor in ``$SPECRL_REDIS_PASSWORD``), or plain ``redis://`` (no TLS).
    Empty for a loopback host or a Unix socket."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or is_loopback_host(parts.hostname):
        return []
    shown = redact_redis_url(url)
    out = []
    if not (parts.password or env_password):
        out.append(
            f"redis.url={shown} points at another machine ({parts.hostname}) and has no "
            f"password: anyone who reaches that port can read and replace the weights. Set "
            f"requirepass on that Redis and give it to every process in ${REDIS_PASSWORD_ENV}"
        )
    if parts.scheme == "redis":
        out.append(
            f"redis.url={shown} reaches {parts.hostname} over plain TCP (redis://, no TLS): the "
            "password and the weights cross the network unencrypted; use rediss:// or keep "
            "Redis on a private network"
        )
    return out


def default_torch_threads() -> int:
    """``run.torch_threads=0``: 1 without a GPU, else this process's cores over the visible GPUs
    (one process per GPU), between 1 and 16. Counting GPUs goes through NVML where it can, so
    it creates no CUDA context."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(16, (cores or 1) // gpus))


TRACKERS = ("wandb", "tensorboard")
"""What ``run.report_to`` may name."""
WANDB_MODES = ("", "online", "offline", "disabled")
"""What ``run.wandb_mode`` may be."""


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
    torch_threads: int = 0
    """``torch.set_num_threads`` per process. 0: 1 on a machine without a GPU (the learner and
    actors share its cores), else this process's cores over the GPUs it sees, at most 16 (CPU
    passes over a real model's weights); :func:`default_torch_threads`."""
    mmap_threshold_bytes: int = 0
    """glibc's mmap threshold in the learner and the actors (``common/heap.py``): blocks of at
    least this size get their own mapping and leave resident memory as soon as they are freed,
    which lowers a training step's peak (the real-model preset sets 4 MiB); every such block
    costs page faults. 0: glibc's dynamic threshold; at most 32 MiB (glibc's ceiling). Ignored
    without glibc."""
    onednn_cache_capacity: int = 0
    """oneDNN's primitive cache, in entries, in the learner and the actors (``common/heap.py``):
    CPU bf16 matmuls cache one entry per shape, and a run meets new shapes every step, so the
    default (1024) grows resident memory for hundreds of steps (the real-model preset sets
    128). 0: oneDNN's default; ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` in the environment wins."""
    log_level: str = "INFO"
    """Python logging level of every process."""
    gpu_profile: bool = True
    """On CUDA with a real model (``model.path`` or a preset): start from the GPU profile's
    defaults, chosen from the model and the devices and logged as a table
    (``common/config/gpu_profile.py``); a value you set is kept. False: the dataclass defaults,
    as on a CPU."""
    tf32: bool = False
    """TF32 tensor cores for fp32 matmuls and convolutions on CUDA (the GPU profile turns it on)."""
    ledger: bool = False
    """Write ``ledger/*.jsonl`` in the run directory: every ``(actor_id, seq)`` sent by actors and
    consumed by the learner (trained, dropped as stale, or pending at exit). For audits and tests."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers the learner also logs every metrics record and the config to:
    ``wandb`` and/or ``tensorboard`` (``pip install 'specrl[trackers]'``), e.g.
    ``run.report_to=[wandb,tensorboard]``. Empty: metrics.jsonl and Prometheus only."""
    wandb_project: str = "specrl"
    """W&B project (``run.report_to`` with ``wandb``); the W&B run is named ``run.name``. The API
    key comes from ``WANDB_API_KEY`` or ``wandb login``, never from the command line."""
    wandb_mode: str = ""
    """W&B mode: ``online``, ``offline`` (files under the run directory, ``wandb sync`` later)
    or ``disabled``; empty: W&B's own choice (``WANDB_MODE``, else online)."""

    def __post_init__(self) -> None:
        require_at_least(
            "run",
            self,
            steps=1,
            torch_threads=0,
            max_wall_s=0,
            mmap_threshold_bytes=0,
            onednn_cache_capacity=0,
        )
        require(
            self.mmap_threshold_bytes <= MMAP_THRESHOLD_MAX,
            f"run.mmap_threshold_bytes must be at most {MMAP_THRESHOLD_MAX} (glibc's ceiling, "
            "32 MiB; 0: its "
            f"dynamic threshold), got {self.mmap_threshold_bytes}",
        )
        for tracker in self.report_to:
            require_choice("run.report_to", tracker, TRACKERS)
        require_choice("run.wandb_mode", self.wandb_mode, WANDB_MODES)
        if self.torch_threads == 0:
            self.torch_threads = default_torch_threads()
        require(
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
        require(
            self.hidden_size > 0 and self.num_heads > 0,
            f"model.hidden_size={self.hidden_size} and model.num_heads={self.num_heads} must be > 0",
        )
        require(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size={self.hidden_size} must be divisible by model.num_heads={self.num_heads}",
        )
        require(
            self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}",
        )
        require_at_least("model", self, num_layers=1, init_steps=0)
        require(
            0 <= self.init_exit_layer < self.num_layers,
            f"model.init_exit_layer={self.init_exit_layer} must be in [0, {self.num_layers - 1}]",
        )


@dataclass
class TaskConfig:
    name: TaskName = "reverse"
    """Prompt source and reward: ``reverse`` (reverse a digit string), ``addition``,
    ``scratchpad`` (addition with a worked column-by-column answer, 60-110 tokens),
    ``word_problems`` (arithmetic word problems in English, for a real model), ``dataset`` (a
    JSONL or Parquet file of prompts with numeric answers; ``jsonl`` is the same task)."""
    path: str = ""
    """``dataset``/``jsonl`` only: the data set: a file (``.jsonl``/``.json`` lines,
    ``.parquet``, ``.arrow``) or a directory saved by ``datasets``' ``save_to_disk``."""
    format: DatasetFormat = "auto"
    """``dataset``/``jsonl`` only: ``jsonl``, ``parquet``, ``arrow``, ``disk`` (a ``save_to_disk``
    directory), or ``auto`` (a directory is ``disk``; a file's suffix names its format)."""
    split: str = "train"
    """``dataset``/``jsonl``: the split of a saved ``DatasetDict`` to train on."""
    eval_path: str = ""
    """``dataset``/``jsonl``: held-out problems from a data set of their own (evaluation)."""
    eval_split: str = ""
    """``dataset``/``jsonl``: held-out problems from this split of a saved ``DatasetDict``."""
    eval_fraction: float = 0.0
    """``dataset``/``jsonl``: hold out this share of the prompts (chosen by a hash of the prompt
    text, the same everywhere); held-out prompts are never trained on."""
    prompt_key: str = "prompt"
    """``dataset``/``jsonl`` only: column (JSON key) of the prompt text; ``a.b`` reads a nested key."""
    answer_key: str = "answer"
    """``dataset``/``jsonl`` only: column of the answer: a number, or a solution whose final answer
    follows ``####`` or sits in ``\\boxed{}``; ``a.b`` reads a nested key."""
    chat_template: ChatTemplateMode = "auto"
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
    reward: str = ""
    """Your reward function instead of the task's: ``<module>:<function>`` or
    ``<file.py>:<function>``, called as ``fn(prompt=, completion=, row=)`` (``row``: the data
    set's row, or the problem's prompt, answer and prompt_id) and returning a number or a dict
    of named numbers; empty: the task's own reward. Runs in worker processes."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weights of the named components a reward function returns (a component not named: 1)."""
    reward_workers: int = 2
    """Worker processes that run ``task.reward`` (calls in parallel)."""
    reward_timeout_s: float = 10.0
    """A reward call still running after this long is stopped and counted (``timeout``)."""
    reward_on_failure: RewardFailureMode = "zero"
    """A call that raises, hangs, returns NaN or kills its worker: ``zero`` (the completion gets
    0, counted) or ``drop_group`` (its group is not sent, counted)."""
    reward_sandbox: bool = False
    """Run ``task.reward`` confined, for rewards that execute model-written code: a fresh process
    per call under bubblewrap (read-only system and Python, no home, run or working directory,
    its own pid and network namespaces, ``task.reward_memory_mb`` of address space, process and
    CPU limits, an allow-listed environment). What it confines and what it does not:
    docs/recipes.md. Refused at start where bubblewrap is missing or cannot make namespaces."""
    reward_memory_mb: int = 1024
    """``task.reward_sandbox``: the address-space limit of each call's process."""

    def __post_init__(self) -> None:
        require_choice("task.name", self.name, TASK_NAMES)
        require(
            not self.is_dataset or bool(self.path),
            f"task.name={self.name} needs task.path=FILE (.jsonl or .parquet)",
        )
        require_choice("task.format", self.format, DATASET_FORMATS)
        if self.is_dataset and self.format == "auto" and not Path(self.path).is_dir():
            suffix = Path(self.path).suffix.lower()
            require(
                suffix in DATASET_SUFFIXES,
                f"task.path={self.path!r}: cannot tell the format from the suffix {suffix!r} "
                f"(known: {', '.join(DATASET_SUFFIXES)}); set task.format=jsonl or parquet",
            )
        require(
            bool(self.prompt_key), f"task.prompt_key must be non-empty, got {self.prompt_key!r}"
        )
        require(
            bool(self.answer_key), f"task.answer_key must be non-empty, got {self.answer_key!r}"
        )
        # Hydra reads `task.chat_template=true` as a bool, which a str field stores as "True".
        chat_template = str(self.chat_template).lower()
        require_choice("task.chat_template", chat_template, CHAT_TEMPLATE_MODES)
        self.chat_template = cast("ChatTemplateMode", chat_template)
        require_ordered("task", self, "min_digits", "max_digits")
        require(
            0.0 <= self.partial_credit < 1.0,
            f"task.partial_credit must be in [0, 1), got {self.partial_credit}",
        )
        require_at_least("task", self, max_new_tokens=0, pool_size=0)
        require_ordered("task", self, "min_steps", "max_steps")
        if self.reward:
            # Only the form here: the file or module is loaded by the actor's reward pool.
            target, sep, function = self.reward.rpartition(":")
            require(
                bool(sep and target and function.isidentifier()),
                f"task.reward={self.reward!r}: expected <module or file.py>:<function>, "
                "e.g. my_rewards:score or rewards/math.py:score",
            )
        require_at_least("task", self, reward_workers=1, reward_memory_mb=64)
        require(
            0.0 <= self.eval_fraction < 1.0,
            f"task.eval_fraction must be in [0, 1), got {self.eval_fraction}",
        )
        require(
            sum(map(bool, (self.eval_path, self.eval_split, self.eval_fraction))) <= 1,
            "task.eval_path, task.eval_split and task.eval_fraction each choose the held-out "
            "problems: set one",
        )
        require(
            self.reward_timeout_s > 0,
            f"task.reward_timeout_s must be > 0, got {self.reward_timeout_s}",
        )
        require_choice("task.reward_on_failure", self.reward_on_failure, REWARD_FAILURE_MODES)
        require(
            all(isinstance(w, int | float) for w in self.reward_weights.values()),
            f"task.reward_weights must map names to numbers, got {dict(self.reward_weights)!r}",
        )

    @property
    def is_dataset(self) -> bool:
        """Prompts come from a file (``dataset``, or its alias ``jsonl``)."""
        return self.name in DATASET_TASKS

    @property
    def natural_language(self) -> bool:
        """Prompts in a natural language, for an HF model with its own tokenizer (a data set or
        ``word_problems``): they go through the chat template under ``chat_template=auto``."""
        return self.is_dataset or self.name == "word_problems"


@dataclass
class RedisConfig:
    url: str = ""
    """Redis URL (``redis://host:port/db``, ``rediss://`` for TLS). Empty: ``specrl run`` starts a
    private server; ``specrl-learner``/``specrl-actor`` use redis://127.0.0.1:6379/0. The
    password goes in ``$SPECRL_REDIS_PASSWORD`` (``redis://:PASSWORD@...`` works too, but puts
    it on the command line); a non-loopback host without a password or TLS is warned about."""
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
    """Where actors on one host share fetched versions (one Redis fetch per host per version), in
    ``specrl-weights-{uid}`` there (created 0700); a copy is hashed against its manifest before
    it is used, and one in a directory or file that is not this user's alone is refused (fetched
    from Redis, counted in ``actor/host_cache_refused``); empty: off (every actor fetches from
    Redis)."""
    publish_to_host_cache: bool = True
    """The node-local weight plane: the learner writes each version into its own
    ``host_cache_dir`` before it commits it in Redis, while an actor reading that same directory
    (same uid; its ``node-id`` file) fetched a version in the last 10 minutes; those actors then
    read no weight bytes from Redis, and the Redis bytes, for other nodes, follow the commit.
    Where no actor shares the learner's directory, it writes nothing there. False: every version
    goes through Redis alone. Needs ``host_cache_dir``."""

    def __post_init__(self) -> None:
        require_at_least("redis", self, chunk_bytes=1024, retention=1, keyframe_every=1)
        require(
            self.retention_bytes >= 0,
            f"redis.retention_bytes must be >= 0 (0: no bound), got {self.retention_bytes}",
        )
        require(
            self.poll_interval_s > 0,
            f"redis.poll_interval_s must be > 0, got {self.poll_interval_s}",
        )
        require(
            not self.host_cache_dir or os.path.isabs(self.host_cache_dir),
            "redis.host_cache_dir must be an absolute path (the learner and the actors of a node "
            f"must name the same directory), got {self.host_cache_dir!r}",
        )
        require(
            isinstance(self.publish_to_host_cache, bool),
            f"redis.publish_to_host_cache must be true or false, got {self.publish_to_host_cache!r}",
        )
        for warning in redis_exposure_warnings(self.url, os.environ.get(REDIS_PASSWORD_ENV, "")):
            logger.warning("%s", warning)

    def resolved_url(self) -> str:
        """The URL to connect to: ``url`` (or the local default) with the password of
        ``$SPECRL_REDIS_PASSWORD`` put in, unless the URL holds one itself."""
        url = self.url or "redis://127.0.0.1:6379/0"
        password = os.environ.get(REDIS_PASSWORD_ENV, "")
        if password and urlsplit(url).password is None:
            return with_redis_password(url, password)
        return url


@dataclass
class EvalConfig:
    """Evaluation on held-out problems during training, on one actor, without stopping the
    learner: avg@k and pass@k of the version it holds, at the run's sampling settings, and
    greedy."""

    every: int = 0
    """Evaluate every this many versions (at the first batch too); 0: never."""
    samples: int = 4
    """k: completions per held-out prompt."""
    prompts: int = 64
    """Held-out prompts evaluated each time (the first this many); 0: all."""
    pass_reward: float = 1.0
    """A completion passes when its reward is at least this (pass@1, pass@k)."""
    greedy: bool = True
    """Also one greedy completion (temperature 0) per held-out prompt: its mean reward and the
    share of prompts it passes."""
    actor: int = 0
    """The actor (``actor.index``) that evaluates."""
    seed: int = 1
    """Built-in tasks: seed that draws the held-out problems (outside the training pool)."""

    def __post_init__(self) -> None:
        require_at_least("eval", self, every=0, samples=1, prompts=0, actor=0)


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature; behaviour log-probs and the learner's log-probs both use it."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    def __post_init__(self) -> None:
        require(self.temperature > 0, f"sampling.temperature must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"sampling.top_p must be in (0, 1], got {self.top_p}")


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
