"""benchmarks/weights.py and benchmarks/transport.py end to end on tiny sizes: real Redis, real
reader/sender/receiver processes, real sockets, and the JSON keys other tools read; the child
processes' helper and the random-model builder they share."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import cli, transport, weights
from benchmarks._procs import ChildFailed, Children

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
    if not script.startswith("_") and script not in (
        "cli",
        "procstat",
        "weight_scaling",
        "rollout_real",
    ):
        assert callable(module.main), script


# The children below run standard-library callables, so a spawned child imports next to nothing.


def test_children_collect_one_message_each_and_end() -> None:
    with Children(timeout_s=60) as children:
        for i in range(2):
            children.start(children.results.put, ("ready", i), name=f"child {i}")
        got = sorted(message[1] for message in children.each("ready"))
    assert got == [0, 1]
    assert [p.exitcode for p in children.procs] == [0, 0]


def test_a_childs_exception_reaches_the_parent_with_its_traceback() -> None:
    with Children(timeout_s=60) as children:
        children.start(int, "not a number", name="parser")
        with pytest.raises(ChildFailed, match="(?s)parser failed.*Traceback.*ValueError"):
            children.get("ready")
    assert children.procs[0].exitcode == 1


def test_a_child_that_dies_silently_is_named_with_its_exit_code() -> None:
    with Children(timeout_s=60) as children:
        children.start(os._exit, 3, name="quitter")
        with pytest.raises(ChildFailed, match=r"quitter \(exit code 3\)"):
            children.get("ready")


def test_a_message_of_another_kind_raises() -> None:
    with Children(timeout_s=60) as children:
        children.start(children.results.put, ("surprise", 1), name="child")
        with pytest.raises(ChildFailed, match="expected ready or fetched, got .*surprise"):
            children.get("ready", "fetched")


def test_silence_times_out_and_close_kills_a_child_that_does_not_end() -> None:
    children = Children(timeout_s=1.0, join_s=0.5)
    with children:
        children.start(time.sleep, 120, name="sleeper")
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no ready message within 1.0 s"):
            children.get("ready")
        assert time.monotonic() - started < 30
    assert children.stop.is_set()
    assert children.procs[0].exitcode == -9  # SIGKILL


def test_random_model_takes_sizes_or_fields_and_builds_in_the_asked_dtype() -> None:
    sizes = (64, 32, 64, 2, 2, 1)
    by_position = cli.random_model(*sizes, seed=3)
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    names += ("num_attention_heads", "num_key_value_heads")
    by_name = cli.random_model(seed=3, **dict(zip(names, sizes, strict=True)))
    assert by_position.args == by_name.args
    for a, b in zip(by_position.parameters(), by_name.parameters(), strict=True):
        assert torch.equal(a, b)
    other = cli.random_model(*sizes, seed=4)
    assert not torch.equal(other.model.embed_tokens.weight, by_position.model.embed_tokens.weight)

    bf16 = cli.random_model(*sizes, seed=3, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
    with pytest.raises(TypeError, match="six sizes by position or none"):
        cli.random_model(64, 32)
