"""The publisher with ``latest_wins``: while an upload runs the learner never waits, the newest
version replaces an older one still waiting and the replaced versions are counted; only uploaded
versions reach Redis, each delta based on one of them, and the republisher still works."""

from __future__ import annotations

import threading

import pytest
import redis
import torch

from common.model import Transformer
from common.tokenizer import CharTokenizer
from common.weights.fetch.reader import WeightReader
from common.weights.keys import weights_versions_key
from common.weights.publish.publisher import LENT_SLOTS, Publisher
from common.weights.publish.upload import Snapshot
from common.weights.publish.writer import WeightWriter
from learner.versions import Republisher

RUN = "latest-wins-run"


def returns_quickly(action, timeout_s: float = 5.0) -> None:
    """Run ``action`` on a thread; it must finish within ``timeout_s`` (the learner must not
    wait for an upload that is held)."""
    done = threading.Thread(target=action)
    done.start()
    done.join(timeout=timeout_s)
    assert not done.is_alive(), "the learner waited for an upload"


def step(m: Transformer, optimizer: torch.optim.Optimizer | None) -> None:
    """One training step that moves one row of the LM head (so versions are small deltas)."""
    if optimizer is None:
        with torch.no_grad():
            m.lm_head.weight[0].add_(0.125)
        return
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    m.lm_head.weight.grad[0] = -0.125
    optimizer.step()  # waits for the last version's snapshot (the publisher's pre-hook)


@pytest.mark.parametrize("upload", ["thread", "process"])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_newest_version_replaces_a_waiting_one_and_the_skips_are_counted(
    redis_client: redis.Redis, upload: str, with_optimizer: bool, tiny_policy, uploads_held
) -> None:
    m = tiny_policy()
    optimizer = torch.optim.SGD(m.parameters(), lr=1.0) if with_optimizer else None
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024, keyframe_every=10, retention=3)
    marks: list[int] = []
    pub = Publisher(
        store,
        m,
        CharTokenizer("abc"),
        dtype=torch.bfloat16,
        max_inflight=1,
        upload=upload,
        latest_wins=True,
        optimizer=optimizer,
        on_published=marks.append,
    )
    expected = {}
    pub.publish(1)
    pub.flush()
    expected[1] = m.lm_head.weight.detach().to(torch.bfloat16).clone()

    def steps_and_publishes(first: int, last: int) -> None:
        for v in range(first, last + 1):
            step(m, optimizer)  # with the optimizer: waits for the last snapshot only
            expected[v] = m.lm_head.weight.detach().to(torch.bfloat16).clone()
            pub.publish(v)

    with uploads_held(pub, store):
        returns_quickly(lambda: steps_and_publishes(2, 5))
        returns_quickly(lambda: step(m, optimizer))  # the next step does not wait either
        # 2 uploads (held); 3 waited and 4 replaced it, 5 replaced 4.
        assert pub.skipped == 2 and pub.inflight == 2
    pub.close()
    assert marks == [1, 2, 5] and pub.published_version == 5 and pub.skipped == 2
    reader = WeightReader(redis_client, RUN)
    for v in (3, 4):
        assert reader.manifest(v) is None  # skipped versions never reach Redis
    for v in (1, 2, 5):
        manifest = reader.manifest(v)
        assert manifest is not None
        assert manifest["kind"] == ("full" if v == 1 else "delta")
        if v > 1:
            assert manifest["base"] == marks[marks.index(v) - 1]  # an uploaded version
        # A fresh reader walks the chain of uploaded versions to the learner's weights.
        held = WeightReader(redis_client, RUN).fetch(v)[1]["lm_head.weight"]
        assert torch.equal(held, expected[v])


@pytest.mark.parametrize("upload", ["thread", "process"])
def test_every_version_is_uploaded_when_uploads_keep_up(
    redis_client: redis.Redis, upload: str, make_publisher
) -> None:
    marks: list[int] = []
    m, pub, store = make_publisher(
        max_inflight=1, upload=upload, latest_wins=True, on_published=marks.append
    )
    for v in range(1, 5):
        step(m, None)
        pub.publish(v)
        pub.flush()
    pub.close()
    assert marks == [1, 2, 3, 4] and pub.skipped == 0
    assert store.latest_version() == 4


def test_retention_keeps_the_newest_uploaded_versions(
    redis_client: redis.Redis, tiny_policy, uploads_held
) -> None:
    m = tiny_policy()
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024, keyframe_every=1, retention=2)
    pub = Publisher(
        store, m, CharTokenizer("abc"), max_inflight=1, upload="thread", latest_wins=True
    )
    for first in (1, 4, 7):
        with uploads_held(pub, store):
            for v in range(first, first + 3):
                step(m, None)
                pub.publish(v)
        pub.flush()
    pub.close()
    assert pub.skipped == 3  # 2, 5 and 8 replaced; 1, 3, 4, 6, 7, 9 uploaded
    assert [int(v) for v in redis_client.zrange(weights_versions_key(RUN), 0, -1)] == [7, 9]


def test_the_republisher_puts_back_a_lost_version_and_waits_for_uploads(
    redis_client: redis.Redis, make_publisher, uploads_held
) -> None:
    m, pub, store = make_publisher(max_inflight=1, upload="thread", latest_wins=True)
    current = {"version": 1}  # the learner's state.version
    pub.publish(1)
    pub.flush()
    republisher = Republisher(
        store,
        lambda: pub.publish(current["version"]),
        every_s=0.0,
        busy=lambda: pub.inflight > 0,
    )
    with uploads_held(pub, store):
        step(m, None)
        current["version"] = 2
        pub.publish(2)
        redis_client.flushdb()  # Redis restarted empty while version 2 uploads
        republisher.check(2)
        assert republisher.republished == 0  # an upload is in flight: nothing is missing yet
    pub.flush()
    assert store.latest_version() == 2
    redis_client.flushdb()  # and again, with nothing in flight
    republisher.check(2)
    pub.close()
    assert republisher.republished == 1 and store.latest_version() == 2


@pytest.mark.parametrize("upload", ["thread", "process"])
def test_a_lent_snapshot_is_not_refilled_until_its_borrower_releases_it(
    redis_client: redis.Redis, upload: str, make_publisher
) -> None:
    """``on_snapshot`` borrows each version as the weights group does: the first one held to
    the end, of the others only the newest (a newer one releases the one before). Versions are
    published faster than a borrower releases them: every held snapshot keeps its version's
    bytes, the uploads still reach Redis, and every slot is free again once all are released."""
    held: list[Snapshot] = []

    def borrow(snapshot: Snapshot) -> None:
        if len(held) > 1:
            held.pop().release()
        held.append(snapshot)

    m, pub, _ = make_publisher(
        dtype=torch.bfloat16, max_inflight=1, upload=upload, latest_wins=True, on_snapshot=borrow
    )
    expected = {}
    for v in range(1, 13):
        step(m, None)
        expected[v] = {k: t.detach().to(torch.bfloat16) for k, t in m.state_dict().items()}
        pub.publish(v)
        if v % 3 == 0:
            pub.flush()  # uploads end and free their slots, for the next versions to refill
    pub.flush()
    assert [s.version for s in held] == [1, 12]
    for snapshot in held:
        assert snapshot.tensors.keys() == expected[snapshot.version].keys()
        for name, t in snapshot.tensors.items():
            assert torch.equal(t, expected[snapshot.version][name]), (snapshot.version, name)
        if upload == "process":  # the borrower reads the upload's own shared-memory slot
            assert pub._child is not None
            assert any(snapshot.payload.data_ptr() == s.data_ptr() for s in pub._child.slots)
    fetched = WeightReader(redis_client, RUN).fetch(12)[1]
    assert all(torch.equal(fetched[k], t) for k, t in expected[12].items())
    for snapshot in held:
        snapshot.release()
        snapshot.release()  # a second release is a no-op
    if pub._child is not None:
        assert pub._child.free.qsize() == len(pub._child.slots) == 2 + LENT_SLOTS
    pub.close()
