"""The ready-version slot both weight feeds hold (common.weights.fetch.feed.ReadySlot), with real
threads: a producer thread offers versions in any order while the decode loop's thread polls;
the loop sees only ever newer versions, ends on the newest, and never waits on a delivery."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from common import metric_names as mn
from common.weights.fetch.feed import ReadySlot


def state_of(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(version))}


class Producer(ReadySlot):
    """A feed whose thread offers ``versions`` in the given order, each after ``fetch_s``."""

    def __init__(self, versions: list[int], current: int = 0, fetch_s: float = 0.0) -> None:
        super().__init__(current)
        self.versions, self.fetch_s = versions, fetch_s
        self.accepted: list[int] = []
        self.done = threading.Event()
        self._spawn(("slot-producer", self._run))

    def _run(self) -> None:
        rng = random.Random(1)
        try:
            for version in self.versions:
                if self._closing.is_set():
                    return
                self._start(version)
                time.sleep(self.fetch_s or rng.random() * 1e-4)
                if version == -99:
                    raise RuntimeError("a bug in the fetch")
                if self._offer(version, state_of(version), self.fetch_s):
                    self.accepted.append(version)
        except Exception as e:  # noqa: BLE001 - the feeds' own pattern
            self._stopped(e, "the test producer")
        finally:
            self.done.set()


def test_out_of_order_offers_reach_the_polling_loop_newest_first_and_never_older():
    rng = random.Random(0)
    versions = [rng.randint(1, 400) for _ in range(300)]  # out of order, with repeats
    slot = Producer(versions)
    taken: list[int] = []
    try:
        while True:
            finished = slot.done.is_set()  # read before the poll: nothing is offered after it
            got = slot.poll()
            if got is not None:
                version, state = got
                assert torch.equal(state["w"], state_of(version)["w"])
                taken.append(version)
            elif finished:
                break
            time.sleep(0)  # a decode step
    finally:
        slot.close()
    # An offer is taken exactly when it is newer than every earlier offer, whatever the polls.
    assert taken == sorted(set(taken)), "the loop was handed a version no newer than one it had"
    assert taken[-1] == max(versions)
    assert len(taken) > 1, "the loop never polled while the producer ran"
    records = [v for i, v in enumerate(versions) if v > max(versions[:i], default=0)]
    assert slot.accepted == records
    assert slot.superseded == len(records) - len(taken)
    assert slot.stats()[mn.ACTOR_WEIGHT_SUPERSEDED] == slot.superseded
    assert not slot.delivering and slot.poll() is None


def test_the_newest_ready_version_wins_and_older_offers_are_dropped():
    slot = Producer([3, 5, 4, 2, 5], current=2)
    assert slot.done.wait(5.0)
    slot.close()
    got = slot.poll()
    assert got is not None and got[0] == 5 and torch.equal(got[1]["w"], state_of(5)["w"])
    assert slot.accepted == [3, 5] and slot.superseded == 1
    assert slot.poll() is None


def test_poll_returns_at_once_while_a_delivery_is_in_progress():
    slot = Producer([7], fetch_s=0.5)
    try:
        deadline = time.monotonic() + 5.0
        while not slot.delivering and time.monotonic() < deadline:
            time.sleep(0.001)
        assert slot.delivering
        started = time.perf_counter()
        assert slot.poll() is None
        assert time.perf_counter() - started < 0.05
        got = slot.wait(timeout_s=5.0)  # wakes when the offer lands, long before the timeout
        assert got is not None and got[0] == 7 and not slot.delivering
        assert slot.stats()[mn.ACTOR_WEIGHT_FETCH_S] == pytest.approx(0.5)
    finally:
        slot.close()


def test_an_error_on_the_thread_is_raised_by_every_later_poll():
    slot = Producer([1, -99, 2])
    assert slot.done.wait(5.0)
    for take in (slot.poll, lambda: slot.wait(timeout_s=5.0), slot.poll):
        with pytest.raises(RuntimeError, match="a bug in the fetch"):
            take()  # the error comes first, even with version 1 still ready
    slot.close()
    assert slot.accepted == [1] and not slot.delivering


def test_close_wakes_a_waiting_loop_and_joins_the_thread():
    slot = Producer([])  # nothing is ever offered: only close wakes the loop
    woke: list[tuple[object, float]] = []
    waiter = threading.Thread(target=lambda: woke.append((slot.wait(30.0), time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    assert not woke
    closing = time.monotonic()
    slot.close()
    waiter.join(timeout=5.0)
    assert woke and woke[0][0] is None and woke[0][1] - closing < 2.0
    assert "slot-producer" not in {t.name for t in threading.enumerate()}
