"""The learner's publisher: versions in the publish dtype, uploaded in order from a snapshot on a
background thread or in a child process, a bound on versions in flight, non-finite weights never
published, and an upload process that dies or cannot reach Redis never hangs the learner."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import redis
import torch

import common.weights.publish.publisher as publisher_module
from common.tokenizer import CharTokenizer
from common.weights.fetch.reader import WeightReader
from common.weights.format import WeightsError
from common.weights.publish.publisher import Publisher
from common.weights.publish.writer import WeightWriter

RUN = "publisher-run"


@pytest.mark.parametrize(
    ("max_inflight", "upload"),
    [(0, "thread"), (1, "thread"), (2, "thread"), (1, "process"), (2, "process")],
)
def test_versions_in_order_from_a_snapshot(
    redis_client: redis.Redis, max_inflight: int, upload: str, make_publisher
) -> None:
    marks: list[int] = []
    m, pub, store = make_publisher(
        dtype=torch.bfloat16,
        max_inflight=max_inflight,
        on_published=marks.append,
        upload=upload,
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
    assert pub.last_publish_bytes > 0 and pub.last_publish_s > 0
    reader = WeightReader(redis_client, RUN)
    kinds = []
    for v in range(1, 6):
        manifest = reader.manifest(v)
        assert manifest is not None and manifest["dtype"] == "bfloat16"
        kinds.append(manifest["kind"])
        assert torch.equal(reader.fetch(v)[1]["lm_head.weight"], expected[v])
    assert kinds == ["full", "delta", "delta", "full", "delta"]  # the uploader keeps the base


def test_snapshot_is_taken_before_the_next_step(
    redis_client: redis.Redis, upload: str, make_publisher, uploads_held
) -> None:
    m, pub, store = make_publisher(max_inflight=1, upload=upload)
    before = m.lm_head.weight.detach().clone()
    with uploads_held(pub, store):
        pub.publish(1)
        with torch.no_grad():
            m.lm_head.weight.add_(1.0)  # the next optimizer step, while the upload waits
    pub.close()
    assert torch.equal(WeightReader(redis_client, RUN).fetch(1)[1]["lm_head.weight"], before)


def test_learner_waits_only_when_max_inflight_versions_are_in_flight(
    upload: str, make_publisher, uploads_held
) -> None:
    _, pub, store = make_publisher(max_inflight=2, upload=upload)
    with uploads_held(pub, store):
        pub.publish(1)
        pub.publish(2)  # two in flight: both returned without waiting for the upload
        assert pub.inflight == 2 and store.latest_version() is None
        third = threading.Thread(target=pub.publish, args=(3,))
        third.start()
        third.join(timeout=0.5)
        assert third.is_alive()  # blocked: the bound holds
    third.join(timeout=10)
    assert not third.is_alive()
    pub.close()
    assert store.latest_version() == 3


def test_non_finite_weights_are_refused_and_counted(upload: str, make_publisher) -> None:
    marks: list[int] = []
    m, pub, store = make_publisher(max_inflight=1, on_published=marks.append, upload=upload)
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


def test_upload_error_is_raised_on_the_learner_thread(upload: str, make_publisher) -> None:
    _, pub, store = make_publisher(max_inflight=1, upload=upload)
    pub.publish(5)
    pub.publish(3)  # versions only grow: the store refuses on the upload thread
    with pytest.raises(WeightsError, match="only grow"):
        pub.flush()
    pub.close()


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_an_optimizer_step_waits_for_the_snapshot_taken_on_the_thread(
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    with_optimizer: bool,
    upload: str,
    tiny_policy,
) -> None:
    """With the optimizer, publish only queues the version and the thread copies the weights;
    the optimizer's step pre-hook must hold the update until that copy is taken. A slow copy
    makes the race certain; without the optimizer the caller copies (negative control: the
    same slow copy then stalls ``publish`` itself)."""
    m = tiny_policy()
    optimizer = torch.optim.SGD(m.parameters(), lr=1.0)
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024)
    slow = Publisher._take

    def slow_take(self: Publisher):
        time.sleep(0.3)
        return slow(self)

    monkeypatch.setattr(Publisher, "_take", slow_take)
    pub = Publisher(
        store,
        m,
        CharTokenizer("abc"),
        max_inflight=1,
        optimizer=optimizer if with_optimizer else None,
        upload=upload,
    )
    before = m.lm_head.weight.detach().clone()
    started = time.perf_counter()
    pub.publish(1)
    publish_s = time.perf_counter() - started
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # with the optimizer: blocks in the pre-hook until the copy is taken
    pub.close()
    assert torch.equal(WeightReader(redis_client, RUN).fetch(1)[1]["lm_head.weight"], before)
    assert not torch.equal(m.lm_head.weight, before)  # the step did happen, after the copy
    assert pub.snapshot_on_thread is with_optimizer
    assert (publish_s < 0.2) is with_optimizer


def test_a_killed_upload_process_is_an_error_on_the_learner_thread(
    redis_client: redis.Redis, make_publisher
) -> None:
    """The version in flight when the child dies is not published, and the learner hears of it
    (it never waits forever for an answer that cannot come)."""
    _, pub, store = make_publisher(max_inflight=1, upload="process")
    pub.publish(1)
    pub.flush()
    assert pub.upload_pid is not None
    os.kill(pub.upload_pid, signal.SIGSTOP)
    pub.publish(2)
    os.kill(pub.upload_pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="upload process .* died"):
        pub.flush()
    assert store.latest_version() == 1 and pub.inflight == 0
    with pytest.raises(RuntimeError, match="died"):
        pub.publish(3)  # the next version goes nowhere either: the learner must stop and restart
    pub.close()


def _dead(pid: int) -> bool:
    """``pid`` exited: a zombie, or already reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_that_dies_between_the_check_and_the_send_is_reported_once_as_dead(
    redis_client: redis.Redis, make_publisher
) -> None:
    """The child passes the liveness check, then dies before the version reaches its pipe: the
    death is what the learner hears (not a BrokenPipeError), and the version is finished once."""
    _, pub, store = make_publisher(max_inflight=1, upload="process")
    pub.publish(1)
    pub.flush()
    child = pub._child
    pid, real_send = child.pid, child.conn.send

    def send_after_the_death(message: object) -> None:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _dead(pid):  # its end of the pipe is closed
            time.sleep(0.01)
        real_send(message)  # BrokenPipeError: nobody reads the pipe any more

    child.conn.send = send_after_the_death
    pub.publish(2)
    with pytest.raises(RuntimeError, match="upload process .* died"):
        pub.flush()
    assert store.latest_version() == 1 and pub.inflight == 0
    with pytest.raises(RuntimeError, match="died"):
        pub.publish(3)
    pub.close()


def test_a_stop_ends_the_retries_while_redis_is_unreachable(upload: str, tiny_policy) -> None:
    """Redis down: the upload retries (a restart must not kill the learner) until the learner
    stops; then flush and close return and nothing is published."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    stop = threading.Event()
    m = tiny_policy()
    store = WeightWriter(redis.Redis(host="127.0.0.1", port=port), RUN)
    pub = Publisher(
        store, m, CharTokenizer("abc"), max_inflight=1, should_stop=stop.is_set, upload=upload
    )
    pub.publish(1)
    time.sleep(1.0)
    assert pub.inflight == 1  # still retrying
    stop.set()
    done = threading.Thread(target=pub.close)
    done.start()
    done.join(timeout=15)
    assert not done.is_alive()
    assert pub.published_version == -1


def test_too_little_shared_memory_falls_back_to_a_thread(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, make_publisher
) -> None:
    """A snapshot slot larger than the free /dev/shm would crash the learner (SIGBUS) on the
    first copy: the publisher uploads on a thread instead, and says why."""
    monkeypatch.setattr(publisher_module, "shm_free_bytes", lambda: 100)
    _, pub, store = make_publisher(max_inflight=1, upload="process")
    assert pub.upload == "thread" and pub.upload_pid is None
    pub.publish(1)
    pub.close()
    assert store.latest_version() == 1
    monkeypatch.setattr(publisher_module, "shm_free_bytes", lambda: 10**12)
    _, pub, _ = make_publisher(max_inflight=1, upload="process")
    assert pub.upload == "process" and pub.upload_pid is not None
    pub.close()


def test_a_tied_lm_head_is_published_once_and_the_engine_ties_it_again(
    redis_client: redis.Redis, upload: str
) -> None:
    from actors.engines.torch.engine import TorchEngine
    from actors.wiring import build_engine
    from common.config import load_config
    from testing.models import random_model

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    m = random_model(64, tie_word_embeddings=True, **shape)
    untied = random_model(64, **shape)
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024, keyframe_every=3)
    pub = Publisher(store, m, CharTokenizer("abc"), max_inflight=1, upload=upload)
    pub.publish(1)
    pub.close()
    reader = WeightReader(redis_client, RUN)
    manifest = reader.manifest(1)
    assert manifest is not None
    assert set(manifest["tensors"]) == set(m.state_dict()) - {"lm_head.weight"}
    head_bytes = m.lm_head.weight.numel() * 4
    # The same layout untied publishes the head too: the tied version is that much smaller.
    other = WeightWriter(redis_client, RUN + "-untied")
    Publisher(other, untied, CharTokenizer("abc"), max_inflight=0).publish(1)
    untied_manifest = WeightReader(redis_client, RUN + "-untied").manifest(1)
    assert untied_manifest is not None
    assert manifest["total_bytes"] <= untied_manifest["total_bytes"] - head_bytes

    # An actor built from the version alone (its first one) and one that loads it.
    built, _, _ = build_engine(reader, 1, load_config([]), seed=4)
    assert built.policy.model.lm_head.weight is built.policy.model.model.embed_tokens.weight
    _, state = reader.fetch(1)
    prompts = [[1, 2, 3], [4, 5]]
    engine = TorchEngine(random_model(64, seed=1, tie_word_embeddings=True, **shape), 0, 0, seed=4)
    engine.load_weights(1, state)
    loaded = engine.policy.model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # one matrix, tied again
    expected = TorchEngine(m, 0, 0, seed=4).generate(prompts, 2, 6)
    got = engine.generate(prompts, 2, 6)
    assert [[r.token_ids.tolist() for r in g] for g in got] == [
        [r.token_ids.tolist() for r in g] for g in expected
    ]


@pytest.mark.parametrize("latest_wins", [False, True])
def test_an_uploaded_snapshot_is_freed_before_the_next_version(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, latest_wins: bool
) -> None:
    """Once a version is uploaded on the thread its snapshot is gone: held until the next
    version arrives, the copy of the weights would sit under the whole next training step."""
    import gc
    import weakref

    from tests.unit.learner.conftest import _tiny_policy

    snapshots: list[weakref.ref] = []
    private = Publisher._private

    def recorded(self: Publisher):
        snapshot = private(self)
        snapshots.append(weakref.ref(snapshot.payload))
        return snapshot

    monkeypatch.setattr(Publisher, "_private", recorded)
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024, keyframe_every=1)  # no delta base
    m = _tiny_policy()
    pub = Publisher(
        store, m, CharTokenizer("abc"), max_inflight=1, upload="thread", latest_wins=latest_wins
    )
    try:
        pub.publish(1)
        pub.flush()
        gc.collect()
        assert pub.published_version == 1 and len(snapshots) == 1
        assert snapshots[0]() is None, "the uploaded snapshot is still referenced"
    finally:
        pub.close()
