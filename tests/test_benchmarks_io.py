"""benchmarks/weights.py and benchmarks/transport.py end to end on tiny sizes: real Redis, real
reader/sender/receiver processes, real sockets, and the JSON keys other tools read."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from benchmarks import transport, weights

pytestmark = pytest.mark.integration


def test_model_shapes_hit_the_target_size() -> None:
    for target, d, vocab in weights.MODELS.values():
        shapes = weights.model_shapes(target, d, vocab)
        params = sum(_prod(s) for s in shapes.values())
        assert abs(4 * params - target) / target < 0.1, (target, 4 * params)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_weights_quick_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The two --quick models at ~1/50 of their size: same code path, seconds instead of tens.
    monkeypatch.setattr(
        weights, "MODELS", {"10mb": (200_000, 64, 256), "100mb": (2_000_000, 128, 512)}
    )
    monkeypatch.setattr(weights, "READERS", (1, 2))  # fewer processes to start
    out = tmp_path / "weights.json"
    monkeypatch.setattr(
        sys, "argv", ["weights.py", "--quick", "--versions", "2", "--json", str(out)]
    )
    assert weights.main() == 0
    figures = json.loads(out.read_text())
    assert figures["fetch_gbps_100mb"] == figures["fetch_gbps_per_reader_100mb_r1"] > 0
    for label in ("10mb", "100mb"):
        for n in weights.READERS:
            for key in ("publish_gbps", "fetch_gbps_aggregate", "seen_ms", "latency_ms"):
                assert f"{key}_{label}_r{n}" in figures
            assert figures[f"latency_ms_{label}_r{n}"] > 0


def test_transport_quick_writes_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_config = transport.run_config

    def shorter(label: str, count: int, outbox_max: int, rtt_probes: int, hwm: int | None):
        return run_config(label, min(count, 100 if label == "small" else 10), outbox_max, 5, hwm)

    monkeypatch.setattr(transport, "run_config", shorter)
    out = tmp_path / "transport.json"
    monkeypatch.setattr(sys, "argv", ["transport.py", "--quick", "--json", str(out)])
    assert transport.main() == 0
    figures = json.loads(out.read_text())
    assert figures["groups_per_s_small"] > 0
    for label in transport.SIZES:
        for suffix in ("", "_run_outbox", "_tuned"):
            assert figures[f"groups_per_s_{label}{suffix}"] > 0
            assert figures[f"mb_per_s_{label}{suffix}"] > 0
            assert figures[f"ack_rtt_ms_p50_{label}{suffix}"] > 0


@pytest.mark.parametrize(
    "script", sorted(p.stem for p in (Path(__file__).parent.parent / "benchmarks").glob("*.py"))
)
def test_every_benchmark_script_imports_and_has_a_command_line(script: str) -> None:
    # A benchmark broken by a change elsewhere (a renamed helper) fails here, not in a long run.
    module = importlib.import_module(f"benchmarks.{script}")
    if script not in ("__init__", "cli", "procstat", "weight_scaling", "rollout_real"):
        assert callable(module.main), script
