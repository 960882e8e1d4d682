"""The learner's publisher: versions in the publish dtype, uploaded in order on a background
thread from a snapshot, a bound on versions in flight, and non-finite weights never published."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from common.model import ModelArgs, Transformer
from common.tokenizer import CharTokenizer
from common.weights import WeightsError, WeightStore
from learner.publisher import Publisher

RUN = "publisher-run"


def model() -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return Transformer(args)


def make(client: redis.Redis, **kwargs) -> tuple[Transformer, Publisher, WeightStore]:
    m = model()
    store = WeightStore(client, RUN, chunk_bytes=1024, keyframe_every=3)
    return m, Publisher(store, m, CharTokenizer("abc"), **kwargs), store


@pytest.mark.parametrize("max_inflight", [0, 1, 2])
def test_versions_in_order_from_a_snapshot(redis_client: redis.Redis, max_inflight: int) -> None:
    marks: list[int] = []
    m, pub, store = make(
        redis_client, dtype=torch.bfloat16, max_inflight=max_inflight, on_published=marks.append
    )
    expected = {}
    for v in range(1, 6):
        with torch.no_grad():
            m.lm_head.weight.add_(0.25)  # a training step
        expected[v] = m.lm_head.weight.detach().to(torch.bfloat16).clone()
        pub.publish(v)
        with torch.no_grad():
            m.lm_head.weight.mul_(0.0)  # the next step mutates the weights right away...
            m.lm_head.weight.add_(expected[v].float())  # ...(restored: one step at a time)
    pub.close()
    assert marks == [1, 2, 3, 4, 5] and pub.published_version == 5
    reader = WeightStore(redis_client, RUN)
    for v in range(1, 6):
        manifest = reader.manifest(v)
        assert manifest is not None and manifest["dtype"] == "bfloat16"
        assert torch.equal(reader.fetch(v)[1]["lm_head.weight"], expected[v])


def test_snapshot_is_taken_before_the_next_step(redis_client: redis.Redis) -> None:
    m, pub, store = make(redis_client, max_inflight=1)
    gate = threading.Event()
    real = store.publish

    def slow_publish(*args, **kwargs):
        gate.wait(timeout=10)
        return real(*args, **kwargs)

    store.publish = slow_publish  # type: ignore[method-assign]
    before = m.lm_head.weight.detach().clone()
    pub.publish(1)
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)  # the next optimizer step, while the upload waits
    gate.set()
    pub.flush()
    assert torch.equal(WeightStore(redis_client, RUN).fetch(1)[1]["lm_head.weight"], before)


def test_learner_waits_only_when_max_inflight_versions_are_in_flight(
    redis_client: redis.Redis,
) -> None:
    _, pub, store = make(redis_client, max_inflight=2)
    gate = threading.Event()
    real = store.publish
    store.publish = lambda *a, **k: (gate.wait(timeout=10), real(*a, **k))[1]  # type: ignore[method-assign]
    pub.publish(1)
    pub.publish(2)  # two in flight: both returned without waiting for the upload
    assert pub.inflight == 2 and store.latest_version() is None
    third = threading.Thread(target=pub.publish, args=(3,))
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive()  # blocked: the bound holds
    gate.set()
    third.join(timeout=10)
    assert not third.is_alive()
    pub.close()
    assert store.latest_version() == 3


def test_non_finite_weights_are_refused_and_counted(redis_client: redis.Redis) -> None:
    marks: list[int] = []
    m, pub, store = make(redis_client, max_inflight=1, on_published=marks.append)
    pub.publish(1)
    with torch.no_grad():
        m.lm_head.weight[0, 0] = float("nan")
    pub.publish(2)
    pub.flush()
    assert pub.refused == 1 and marks == [1]
    assert store.latest_version() == 1 and store.manifest(2) is None
    with torch.no_grad():
        m.lm_head.weight[0, 0] = 0.0
    pub.publish(3)  # the learner goes on; the next finite version is published
    pub.close()
    assert store.latest_version() == 3


def test_upload_error_is_raised_on_the_learner_thread(redis_client: redis.Redis) -> None:
    _, pub, store = make(redis_client, max_inflight=1)
    pub.publish(5)
    pub.publish(3)  # versions only grow: the store refuses on the upload thread
    with pytest.raises(WeightsError, match="only grow"):
        pub.flush()
    pub.close()


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_an_optimizer_step_waits_for_the_snapshot_taken_on_the_thread(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, with_optimizer: bool
) -> None:
    """With the optimizer, publish only queues the version and the thread copies the weights;
    the optimizer's step pre-hook must hold the update until that copy is taken. A slow copy
    makes the race certain; without the optimizer the caller copies (negative control: the
    same slow copy then stalls ``publish`` itself)."""
    m = model()
    optimizer = torch.optim.SGD(m.parameters(), lr=1.0)
    store = WeightStore(redis_client, RUN, chunk_bytes=1024)
    slow = Publisher.snapshot

    def slow_snapshot(self: Publisher) -> dict[str, torch.Tensor]:
        time.sleep(0.3)
        return slow(self)

    monkeypatch.setattr(Publisher, "snapshot", slow_snapshot)
    pub = Publisher(
        store,
        m,
        CharTokenizer("abc"),
        max_inflight=1,
        optimizer=optimizer if with_optimizer else None,
    )
    before = m.lm_head.weight.detach().clone()
    started = time.perf_counter()
    pub.publish(1)
    publish_s = time.perf_counter() - started
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # with the optimizer: blocks in the pre-hook until the copy is taken
    pub.close()
    assert torch.equal(WeightStore(redis_client, RUN).fetch(1)[1]["lm_head.weight"], before)
    assert not torch.equal(m.lm_head.weight, before)  # the step did happen, after the copy
    assert pub.snapshot_on_thread is with_optimizer
    assert (publish_s < 0.2) is with_optimizer
