"""What the publisher tests share: a tiny policy, a publisher on the real Redis of the session
(under the test module's ``RUN``), both ways it uploads, and a way to hold its uploads; what the
warm-draft tests share: the tiny model they warm up."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from common.config import load_config
from common.model import Transformer
from common.tokenizer import CharTokenizer
from common.weights.publish.publisher import Publisher
from common.weights.publish.writer import WeightWriter
from learner.prepare.warm_start import warm_start
from testing.models import random_model
from testing.warm_draft import TINY


def _tiny_policy() -> Transformer:
    return random_model(16, hidden_size=16, intermediate_size=32, num_hidden_layers=1).train()


@contextlib.contextmanager
def _uploads_held(pub: Publisher, store: WeightWriter) -> Iterator[None]:
    """Every upload waits until the block exits: the upload process stopped (SIGSTOP), or a
    gate in the store's publish on the upload thread."""
    if pub.upload_pid is not None:
        os.kill(pub.upload_pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pub.upload_pid, signal.SIGCONT)
        return
    gate = threading.Event()
    real = store.publish

    def gated(*args, **kwargs) -> None:
        gate.wait(timeout=10)
        real(*args, **kwargs)

    store.publish = gated  # type: ignore[method-assign]
    try:
        yield
    finally:
        gate.set()
        store.publish = real  # type: ignore[method-assign]


@pytest.fixture
def tiny_policy() -> Callable[[], Transformer]:
    """Makes a fresh tiny policy (training mode) each call."""
    return _tiny_policy


@pytest.fixture
def make_publisher(
    request: pytest.FixtureRequest, redis_client: redis.Redis
) -> Callable[..., tuple[Transformer, Publisher, WeightWriter]]:
    """``make_publisher(**kwargs)``: a tiny policy, its ``Publisher(**kwargs)`` and the store
    (1 KiB chunks, a keyframe every 3 versions) under the module's ``RUN``."""
    run = request.module.RUN

    def make(**kwargs) -> tuple[Transformer, Publisher, WeightWriter]:
        m = _tiny_policy()
        store = WeightWriter(redis_client, run, chunk_bytes=1024, keyframe_every=3)
        return m, Publisher(store, m, CharTokenizer("abc"), **kwargs), store

    return make


@pytest.fixture
def uploads_held() -> Callable[[Publisher, WeightWriter], contextlib.AbstractContextManager]:
    """``with uploads_held(pub, store):`` every upload of ``pub`` waits until the block exits."""
    return _uploads_held


@pytest.fixture(params=["thread", "process"])
def upload(request: pytest.FixtureRequest) -> str:
    """Where a publisher uploads: on a background thread, or in a child process."""
    return request.param


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model of :data:`testing.warm_draft.TINY`, built once per test module: a test that
    changes it works on a copy."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    warm_start(load_config(TINY), out)
    return out
