"""``specrl report``: a PNG page and a markdown of key figures from a synthetic metrics file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.cli import main as cli_main
from ops.report import ReportError, write_report
from ops.run_summary import summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir: Path, steps: int = 40, staleness_hist: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(1, steps + 1):
        row = {
            "time": 1_000.0 + 2.0 * i,
            "elapsed_s": 5.0 + 2.0 * i,
            "learner/step": i,
            "learner/version": i + 1,
            "learner/reward_mean": 0.2 + 0.6 * i / steps,
            "learner/groups": 4,
            "learner/tokens": 400,
            "learner/staleness_mean": 1.0,
            "learner/staleness_max": 2,
            "learner/dropped_stale": 3,
            "receiver/duplicates": 2,
            "receiver/bad_frames": 1,
            "receiver/bad_frames/bad_field": 1,
            "actor/tokens_per_s": 1500.0,
            "spec/acceptance_rate": 0.2 + 0.5 * i / steps,
            "spec/mean_accepted_len": 2.5,
            "spec/acceptance_pos1": 0.8,
            "spec/acceptance_pos2": 0.5,
            "spec/acceptance_pos10": 0.1,
            "spec/draft_acceptance": 0.4 + 0.2 * i / steps,
            "learner/wait_s": 1.0,
            "learner/train_s": 0.8,
            "learner/publish_s": 0.2,
            "learner/wall_s": 2.0 * i,
        }
        if staleness_hist:
            row["learner/staleness_hist"] = [1, 2, 1]
        rows.append(row)
    rows.append({"time": 1_100.0, "elapsed_s": 100.0, "event": "learner_exit", "learner/step": 40})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # six drawn panels, not an empty canvas


def test_report_writes_png_and_figures(tmp_path):
    run_dir = tmp_path / "run-a"
    write_metrics(run_dir)
    png, md = write_report(run_dir)
    assert png == run_dir / "report.png" and md == run_dir / "report.md"
    check_png(png)
    text = md.read_text()
    assert "# specrl run report: run-a" in text
    assert "outcome" not in text  # no summary.json: nothing to say about it
    assert "[report.png](report.png)" in text
    assert "| learner steps | 40 |" in text
    assert "| policy versions | 2 → 41 |" in text
    assert "| groups trained / dropped as stale / duplicates dropped | 160 / 3 / 2 |" in text
    assert "| bad frames | 1 (bad_field: 1) |" in text
    assert "1.00 (max 2)" in text  # exact mean of the [1, 2, 1] histogram
    assert "0.23 → 0.68" in text  # acceptance, first → last 10% of steps
    assert "1,500" in text
    assert "| acceptance by draft position | 1: 0.80, 2: 0.50, 10: 0.10 |" in text
    # The learner's measure of the draft on each batch before its update: 0.4 + 0.2 i / 40,
    # steps 1-4 then 37-40.
    learner_side = text.split("before its update (learner), first 10% → last 10% | ")[1]
    before, after = (float(x) for x in learner_side.split(" |")[0].split(" → "))
    assert before == pytest.approx(0.4 + 0.2 * 2.5 / 40, abs=1e-3)
    assert after == pytest.approx(0.4 + 0.2 * 38.5 / 40, abs=1e-3)
    assert "| learner busy (train + publish) / idle (wait) | 50% / 50% |" in text
    first, last = (
        text.split("mean reward, first 10% of steps → last 10% | ")[1].split(" |")[0].split(" → ")
    )
    assert float(first) < float(last)


def test_summary_uses_exact_staleness_and_busy_fraction_across_a_resume(tmp_path):
    write_metrics(tmp_path, steps=10)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows[5]["learner/wall_s"] = 2.0  # a resumed learner restarts its wall clock
    for i, r in enumerate(rows[6:-1], start=2):
        r["learner/wall_s"] = 2.0 * i
    summary = summarize(rows, wall_s=1.0)
    assert summary["staleness_hist"] == [10, 20, 10]
    assert summary["staleness_mean"] == pytest.approx(1.0)
    assert summary["learner_busy_frac"] == pytest.approx(10 * 1.0 / (10.0 + 10.0))


def test_missing_keys_give_no_data_panels(tmp_path):
    run_dir = tmp_path / "sparse"
    run_dir.mkdir()
    rows = [
        {
            "time": 10.0 + i,
            "elapsed_s": float(i),
            "learner/step": i,
            "learner/version": i,
            "learner/reward_mean": 0.5,
        }
        for i in range(1, 4)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png, md = write_report(run_dir)
    assert png.read_bytes()[:8] == PNG_MAGIC
    text = md.read_text()
    assert "| learner steps | 3 |" in text
    assert "n/a → n/a" in text  # no acceptance recorded


def test_cli_report(tmp_path, capsys):
    write_metrics(tmp_path / "run-b", staleness_hist=False)
    (tmp_path / "run-b" / "summary.json").write_text('{"outcome": "interrupted"}')
    assert cli_main(["report", str(tmp_path / "run-b")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "run-b" / "report.png") in out
    assert str(tmp_path / "run-b" / "report.md") in out
    check_png(tmp_path / "run-b" / "report.png")
    text = (tmp_path / "run-b" / "report.md").read_text()
    assert "mean of per-step means" in text
    assert "| outcome | interrupted |" in text


@pytest.mark.parametrize("case", ["missing dir", "no metrics file", "empty metrics", "no steps"])
def test_cli_report_bad_input_is_a_message_not_a_traceback(tmp_path, capsys, case):
    run_dir = tmp_path / "run"
    if case != "missing dir":
        run_dir.mkdir()
    if case == "empty metrics":
        (run_dir / "metrics.jsonl").write_text("")
    if case == "no steps":
        (run_dir / "metrics.jsonl").write_text('{"event": "learner_exit"}\n')
    assert cli_main(["report", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("specrl report: ") and str(run_dir) in err
    assert "Traceback" not in err
    with pytest.raises(ReportError):
        write_report(run_dir)
    assert not (run_dir / "report.png").exists()


def test_cli_report_usage(capsys):
    assert cli_main(["report"]) == 2
    assert "usage: specrl report RUN_DIR" in capsys.readouterr().err
