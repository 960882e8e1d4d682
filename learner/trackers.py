"""Experiment trackers: the learner's metrics records and the run's config also go to W&B and/or
TensorBoard (``run.report_to``), beside metrics.jsonl and Prometheus.

Each record's numeric values are logged at the learner step it carries (``learner/step``); text
values and gaps (NaN, inf) are left out. A tracker that fails while logging is switched off with
one warning: a tracker never stops training. Both libraries are optional
(``pip install 'specrl[trackers]'``); naming one that is not installed stops the learner at start
with how to install it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from common import metric_names as mn
from common.config import SpecRLConfig, redacted_yaml

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
"""Where TensorBoard's event files go, under the run directory."""


class TrackerMissing(RuntimeError):
    """``run.report_to`` names a tracker whose library is not installed."""


class Tracker(Protocol):
    name: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record (booleans as 0/1), without the step itself."""
    out = {}
    for key, value in record.items():
        if key == mn.LEARNER_STEP or isinstance(value, str) or value is None:
            continue
        if isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class TensorBoardTracker:
    """Scalars to ``{run_dir}/tensorboard`` through torch's SummaryWriter; the config as text."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config_yaml: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerMissing(_missing("tensorboard", e)) from e
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))
        self.writer.add_text("config", "```yaml\n" + config_yaml + "```", 0)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named ``run.name`` in ``run.wandb_project``, its files under the run directory,
    the whole config as its config."""

    name = "wandb"

    def __init__(self, cfg: SpecRLConfig, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise TrackerMissing(_missing("wandb", e)) from e
        self.run = wandb.init(
            project=cfg.run.wandb_project,
            name=cfg.run.name,
            dir=str(run_dir),
            config=config,
            mode=cfg.run.wandb_mode or None,  # type: ignore[arg-type]
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() only tells wandb-core the run is over; its files are flushed and closed when
        # the service stops. Stop it here, so that they are complete when close returns (the
        # atexit hook that would do it does not run in every kind of child process).
        wandb.teardown()


def _missing(library: str, error: ImportError) -> str:
    return (
        f"run.report_to names {library}, which cannot be imported ({error}): "
        "pip install 'specrl[trackers]' (or drop it from run.report_to)"
    )


class Trackers:
    """The trackers of ``run.report_to``, fed each learner record; none: it does nothing."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @classmethod
    def open(cls, cfg: SpecRLConfig, run_dir: Path) -> Trackers:
        names = list(dict.fromkeys(cfg.run.report_to))
        if not names:
            return cls([])
        from omegaconf import OmegaConf

        config_yaml = redacted_yaml(cfg)
        config = OmegaConf.to_container(OmegaConf.create(config_yaml))
        opened: list[Tracker] = []
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(run_dir, config_yaml))
            else:
                opened.append(WandbTracker(cfg, run_dir, config))  # type: ignore[arg-type]
        return cls(opened)

    def log(self, record: Mapping[str, Any]) -> None:
        """One metrics record, at its ``learner/step`` (records without one are not logged)."""
        step = record.get(mn.LEARNER_STEP)
        if not isinstance(step, int) or not self.trackers:
            return
        values = numeric(record)
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step)
            except Exception as e:  # noqa: BLE001  (a tracker never stops training)
                log.warning("learner: tracker %s failed (%s); it is switched off", tracker.name, e)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                log.warning("learner: closing tracker %s failed (%s)", tracker.name, e)
        self.trackers = []
