"""Experiment trackers (``run.report_to``): what the learner hands them is what TensorBoard's and
W&B's own files hold, read back with each library's reader; a failing tracker never stops training."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from common import metric_names as mn
from common.config import load_config
from learner.trackers import TENSORBOARD_DIR, TrackerMissing, Trackers

RECORDS = [
    {mn.LEARNER_STEP: 1, mn.LEARNER_LOSS: 0.5, mn.LEARNER_KL: 0.01, "note": "text", "gap": None},
    {mn.LEARNER_STEP: 2, mn.LEARNER_LOSS: 0.25, mn.LEARNER_KL: float("nan")},
    {"event": "no step here", mn.LEARNER_LOSS: 9.0},
]


def feed(trackers: Trackers) -> None:
    for record in RECORDS:
        trackers.log(record)
    trackers.close()


def test_tensorboard_holds_every_numeric_metric_at_its_step_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(["run.report_to=[tensorboard]", "run.name=tb-run"])
    feed(Trackers.open(cfg, tmp_path))
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"tensors": 0})
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars(mn.LEARNER_LOSS)]
    assert loss == [(1, 0.5), (2, 0.25)]  # the record without a step is not logged
    kl = [(e.step, pytest.approx(e.value)) for e in events.Scalars(mn.LEARNER_KL)]
    assert kl == [(1, 0.01)]  # NaN is a gap, not a point
    assert set(events.Tags()["scalars"]) == {mn.LEARNER_LOSS, mn.LEARNER_KL}
    (config,) = events.Tensors("config/text_summary")
    assert b"tb-run" in config.tensor_proto.string_val[0]


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (LevelDB log framing after a 7-byte W&B header)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, partial, block, pos = [], b"", 32768, 7
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # FULL
            records.append(payload)
        elif kind == 2:  # FIRST
            partial = payload
        elif kind == 3:  # MIDDLE
            partial += payload
        elif kind == 4:  # LAST
            records.append(partial + payload)
    return records


def test_wandb_offline_run_holds_every_numeric_metric_at_its_step_and_the_config(
    tmp_path, monkeypatch, caplog
):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        ["run.report_to=[wandb]", "run.wandb_mode=offline", "run.name=wb-run", "learner.lr=1e-5"]
    )
    feed(Trackers.open(cfg, tmp_path))  # close() returns once W&B's files are complete
    assert "tracker wandb failed" not in caplog.text
    (log_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history, config, names = {}, {}, []
    for raw in wandb_records(log_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                config[item.key] = json.loads(item.value_json)
            if kind == "run":
                names.append(record.run.display_name)
    assert history == {
        1: {mn.LEARNER_LOSS: 0.5, mn.LEARNER_KL: 0.01},
        2: {mn.LEARNER_LOSS: 0.25},
    }
    assert names == ["wb-run"]
    # The whole config, one entry per top-level key (W&B may wrap each value in {"value": ...}).
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    assert config["learner"]["lr"] == 1e-5
    assert config["run"]["name"] == "wb-run"


class Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, values, step):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        raise OSError("still full")


class Kept:
    name = "kept"

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, values, step):
        self.logged.append((step, dict(values)))

    def close(self):
        pass


def test_a_failing_tracker_is_switched_off_and_the_others_go_on(caplog):
    broken, kept = Broken(), Kept()
    trackers = Trackers([broken, kept])
    feed(trackers)
    assert broken.calls == 1  # switched off after its first failure
    assert [step for step, _ in kept.logged] == [1, 2]
    assert "tracker broken failed (disk full); it is switched off" in caplog.text


def test_a_tracker_that_is_not_installed_is_named_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = load_config(["run.report_to=[wandb]"])
    with pytest.raises(TrackerMissing, match=r"pip install 'specrl\[trackers\]'"):
        Trackers.open(cfg, tmp_path)


@pytest.mark.parametrize(
    "override", ["run.report_to=[mlflow]", "run.report_to=[wandb,tensorbord]", "run.wandb_mode=on"]
)
def test_unknown_trackers_and_modes_are_refused(override):
    with pytest.raises(ValueError, match="run.report_to|run.wandb_mode"):
        load_config([override])


def test_no_tracker_by_default(tmp_path):
    trackers = Trackers.open(load_config([]), tmp_path)
    feed(trackers)
    assert list(tmp_path.iterdir()) == []
