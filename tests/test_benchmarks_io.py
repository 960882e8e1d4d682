"""benchmarks/weights.py and benchmarks/transport.py end to end on tiny sizes: real Redis, real
reader/sender/receiver processes, real sockets, and the JSON keys other tools read; the child
processes' helper and the random-model builder they share."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
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


BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
# Every module of benchmarks/, a package's modules (the GPU check's stages) included, by name.
MODULES = sorted(
    ".".join(p.relative_to(BENCHMARKS).with_suffix("").parts).removesuffix(".__init__")
    for p in BENCHMARKS.rglob("*.py")
)


def test_the_module_list_sees_packages() -> None:
    assert {"rollout", "gpu_check", "gpu_check.__main__", "gpu_check.run"} <= set(MODULES)


@pytest.mark.parametrize("script", MODULES)
def test_every_benchmark_script_imports_and_has_a_command_line(script: str) -> None:
    # A benchmark broken by a change elsewhere (a renamed helper) fails here, not in a long run.
    module = importlib.import_module(f"benchmarks.{script}")
    if script.startswith("gpu_check"):
        assert callable(importlib.import_module("benchmarks.gpu_check.__main__").main)
    elif not script.startswith("_") and script not in (
        "cli",
        "procstat",
        "weight_scaling",
        "rollout_real",
        "eagle_rows",
        "heldout_wording",
        "engines_eagle",
        "engines_real",
        "real_preset",
        "weight_delivery",
        "vllm_kit",
        "publish_stages",
        "node_stages",
        "multiturn_exact",
        "multiturn_rows",
        "multiturn_chaos",
        "multiturn_faults",
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


RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def test_write_json_adds_commit_dirty_and_command_unless_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = Path(cli.__file__).parent / "example.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--json", "out dir/x.json"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # run as a script
    out = tmp_path / "x.json"
    cli.write_json({"figure": 1.5}, out)
    written = json.loads(out.read_text())
    assert written["figure"] == 1.5
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=cli.ROOT, capture_output=True, text=True, check=True
    )
    assert written["commit"] == head.stdout.strip()
    assert isinstance(written["dirty"], bool)
    assert written["command"] == "python benchmarks/example.py --json 'out dir/x.json'"

    cli.write_json({"commit": "abc", "dirty": None, "command": "by hand"}, out)
    assert json.loads(out.read_text()) == {"commit": "abc", "dirty": None, "command": "by hand"}


def test_every_committed_result_says_where_it_comes_from() -> None:
    paths = sorted(RESULTS.glob("*.json"))
    assert paths
    for path in paths:
        figures = json.loads(path.read_text())
        missing = [k for k in cli.PROVENANCE_KEYS if k not in figures]
        assert not missing, (path.name, missing)
        assert figures["commit"] and figures["command"], path.name
        assert figures["dirty"] in (True, False, None), path.name


def test_every_benchmark_writes_its_json_through_cli() -> None:
    # cli.write_json adds the provenance; a script that writes its figures itself would not.
    for path in sorted(BENCHMARKS.rglob("*.py")):
        if path.name == "cli.py":
            continue
        text = path.read_text()
        assert "json.dump(" not in text, path.name
        for line in text.splitlines():
            if ".write_text(json.dumps" in line:
                # learner.py's per-rank files, the node check's per-process files: scratch
                # read back by the script that writes the JSON through cli
                assert "rank" in line or "scratch" in line, (path.name, line)


def test_scratchpad_rl_reads_a_run_into_the_committed_format(tmp_path: Path) -> None:
    from benchmarks import scratchpad_rl
    from common import metric_names as mn

    rows = [
        {
            mn.LEARNER_STEP: i + 1,
            mn.LEARNER_VERSION: i + 1,
            mn.LEARNER_REWARD_MEAN: 0.1 * (i % 3),
            mn.LEARNER_GROUPS: 16,
            mn.LEARNER_WALL_S: 2.0 * (i + 1),
            mn.ACTOR_TOKENS_PER_S: 100.0,
            mn.SPEC_ACCEPTANCE_RATE: 0.5,
        }
        for i in range(10)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("task:\n  partial_credit: 0.5\n")
    (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 21.5}))
    out = scratchpad_rl.figures(tmp_path)
    assert out["steps"] == 10 and out["wall_s"] == 21.5 and out["groups_trained"] == 160
    quarters = out["reward_by_quarter"]
    assert [q["steps"] for q in quarters] == [[1, 2], [3, 5], [6, 7], [8, 10]]
    assert quarters[0]["reward_mean"] == 0.05 and quarters[0]["standard_error"] == 0.05
    committed = json.loads((RESULTS / "scratchpad_rl_15min.json").read_text())
    by_hand = {"command", "commit", "dirty", "machine", "provenance_note"}
    assert set(out) == set(committed) - by_hand
    assert set(quarters[0]) == set(committed["reward_by_quarter"][0])
