"""Hydra structured configs: one dataclass per section, a docstring under every field.

Entry points compose ``configs/config.yaml`` with command-line overrides
(``specrl-actor learner.address=tcp://10.0.0.5:5555 redis.url=redis://10.0.0.5:6379/0``) and
turn the result into a typed :class:`SpecRLConfig`; ``__post_init__`` checks reject bad values at
start with a message that quotes them. Code below the entry points receives typed sub-configs,
never a raw DictConfig.

The dataclasses hold every default; a YAML group option (``configs/<group>/<option>.yaml``) sets
only the fields that option changes.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

from common.config.actor import ActorConfig, EngineConfig, SpecConfig
from common.config.checks import require
from common.config.env import EnvConfig, check_env_bounds
from common.config.learner import LearnerConfig
from common.config.modes import VLLM_INFLIGHT_MODES
from common.config.run import (
    EvalConfig,
    ModelConfig,
    RedisConfig,
    RunConfig,
    SamplingConfig,
    SecurityConfig,
    TaskConfig,
    redact_redis_url,
)

CONFIG_DIR_ENV = "SPECRL_CONFIG_DIR"


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        self.spec = self.spec.for_engine(self.engine.name)  # spec.method=auto, per engine
        uses_exit = self.spec.uses_early_exit or self.spec.aux_coef > 0
        # The built-in model's depth is known here; a model.path model is checked when loaded.
        if uses_exit and not self.model.path:
            require(
                self.spec.exit_layer < self.model.num_layers,
                f"spec.exit_layer={self.spec.exit_layer} must be below model.num_layers={self.model.num_layers}",
            )
        require(
            not self.spec.uses_eagle or self.learner.model_impl != "hf",
            "spec.method=eagle3 needs the built-in model (learner.model_impl=builtin or auto): "
            "the EAGLE-3 head is part of common.model.Transformer",
        )
        require(
            self.engine.name != "vllm" or self.actor.inflight in VLLM_INFLIGHT_MODES,
            f"engine=vllm supports actor.inflight={', '.join(VLLM_INFLIGHT_MODES)}, got "
            f"{self.actor.inflight!r} (verify_on_finish runs on the torch engine)",
        )
        require(
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
        require(
            not self.eval.every or self.eval.actor < self.actor.num_actors,
            f"eval.actor={self.eval.actor} must be below actor.num_actors={self.actor.num_actors}",
        )
        require(
            not self.eval.every
            or not self.task.is_dataset
            or bool(self.task.eval_path or self.task.eval_split or self.task.eval_fraction),
            "eval.every on a data set needs held-out problems: task.eval_fraction, "
            "task.eval_path or task.eval_split",
        )
        require(
            not self.task.natural_language or bool(self.model.path),
            f"task={self.task.name} needs model.path=HF_DIR or a real-model preset "
            "(model=smollm2-135m); the built-in tiny model only knows built-in tasks",
        )
        check_env_bounds(self.env, self.learner, self.engine)


def config_dir() -> Path:
    """The YAML config tree: ``$SPECRL_CONFIG_DIR`` or ``configs/`` beside the packages."""
    env = os.environ.get(CONFIG_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "configs"
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no config.yaml in {path}; set {CONFIG_DIR_ENV} to the configs/ folder"
        )
    return path


def load_config(overrides: list[str] | None = None) -> SpecRLConfig:
    """Compose ``configs/config.yaml`` with Hydra overrides and validate it into dataclasses."""
    # Hydra is imported here, not at module level: the dataclasses serve code that runs without
    # it (scripts/gpu-check.sh on a machine with torch alone).
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="specrl_schema", node=SpecRLConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="spec", name="spec_schema", node=SpecConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        raw = compose(config_name="config", overrides=list(overrides or []))
    cfg = OmegaConf.to_object(raw)
    assert isinstance(cfg, SpecRLConfig)
    return cfg


def to_yaml(cfg: SpecRLConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def redacted_yaml(cfg: SpecRLConfig) -> str:
    """``cfg`` as YAML wherever it is kept or shown (``{run_dir}/config.yaml``, the trackers'
    run config), with any password in ``redis.url`` replaced by ``***``."""
    shown = copy.deepcopy(cfg)
    shown.redis.url = redact_redis_url(shown.redis.url)
    return to_yaml(shown)
