"""The progress display follows metrics.jsonl through MetricsTail: each byte read once, a line
still being written held back until its newline, a replaced file read from its start."""

from __future__ import annotations

import json

from ops.metrics_file import MetricsTail, read_metrics


def _line(step: int) -> bytes:
    return (json.dumps({"learner/step": step}) + "\n").encode()


def test_the_tail_returns_each_record_once_and_waits_for_a_whole_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.new_records() == []  # no file yet
    path.write_bytes(_line(1) + _line(2))
    assert [r["learner/step"] for r in tail.new_records()] == [1, 2]
    assert tail.new_records() == []  # nothing new: nothing read again
    half = _line(3)
    with path.open("ab") as f:
        f.write(half[:7])  # the writer is mid-line
    assert tail.new_records() == []
    with path.open("ab") as f:
        f.write(half[7:] + b"not json\n" + _line(4))
    assert [r["learner/step"] for r in tail.new_records()] == [3, 4]
    assert [r["learner/step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_a_file_that_shrank_is_read_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_line(1) + _line(2) + _line(3))
    tail = MetricsTail(path)
    assert len(tail.new_records()) == 3
    path.write_bytes(_line(7))  # a new run's file in the same place
    assert [r["learner/step"] for r in tail.new_records()] == [7]


def test_the_tail_reads_only_what_was_appended(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(_line(i) for i in range(1000)))
    tail = MetricsTail(path)
    assert len(tail.new_records()) == 1000
    read_sizes: list[int] = []
    real_open = type(path).open

    def counting_open(self, *args, **kwargs):
        f = real_open(self, *args, **kwargs)
        real_read = f.read
        f.read = lambda n=-1: read_sizes.append(n) or real_read(n)  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(type(path), "open", counting_open)
    with real_open(path, "ab") as f:
        f.write(_line(1000))
    assert [r["learner/step"] for r in tail.new_records()] == [1000]
    assert read_sizes == [len(_line(1000))]
