"""The weights group (the NCCL/collective byte path) refused on CUDA with its reason, decided by
one function of a device description (common/config/learner.py ``weights_group_refusal``), at
config time for an actor and at start for the learner, before its process group or model; gloo
on CPU stays allowed (its own tests: test_weights_collective.py,
tests/integration/test_weights_group.py). No GPU is needed: the device detection is mocked."""

from __future__ import annotations

import pytest
import torch

import common.weights.collective as wc
import learner.loop as learner_loop
from common.config import load_config
from common.config.actor import ActorConfig
from common.config.learner import WEIGHTS_GROUP_ON_CUDA, weights_group_refusal
from common.weights.fetch.collective_feed import CollectiveReceiver
from common.weights.publish.collective_sender import CollectiveSender

# What the refusal must say: each reason the path would fail on a GPU node, and the way round.
REASONS = (
    "has not been run on a GPU",
    "GPU memory beside vLLM",  # a whole version received on the actor's GPU: out of memory
    "out of memory",
    "NCCL watchdog",  # a dead or paused member kills the learner
    "kill learner rank 0",
    "127.0.0.1",  # the default address, unreachable from another container
    "another container cannot reach",
    "Redis weight store",  # the supported path
    "learner.weights_group and actor.weights_group off",
)


def says_why(message: str) -> None:
    missing = [r for r in REASONS if r not in message]
    assert not missing, (missing, message)


@pytest.mark.parametrize(
    "device, backend",
    [
        ("cuda", ""),
        ("cuda:3", ""),
        (" CUDA:0 ", ""),
        (torch.device("cuda", 1), ""),
        ("cpu", "nccl"),
        ("", "NCCL"),
    ],
)
def test_cuda_devices_and_nccl_are_refused_with_the_reason(device, backend):
    refusal = weights_group_refusal(device, backend)
    assert refusal == WEIGHTS_GROUP_ON_CUDA
    says_why(refusal)


@pytest.mark.parametrize(
    "device, backend",
    [("cpu", ""), ("cpu", "gloo"), (torch.device("cpu"), "gloo"), ("mps", ""), ("cudax", "")],
)
def test_cpu_and_gloo_are_allowed(device, backend):
    assert weights_group_refusal(device, backend) is None


def test_the_group_refuses_a_cuda_device_before_binding_anything():
    """check_device, the sender and the receiver: CollectiveError with the reason, before the
    sender's store listens or the receiver touches Redis (no client is given)."""
    with pytest.raises(wc.CollectiveError) as refused:
        wc.check_device(torch.device("cuda", 0))
    says_why(str(refused.value))
    wc.check_device(torch.device("cpu"))
    with pytest.raises(wc.CollectiveError) as refused:
        CollectiveSender(None, "run", "127.0.0.1:1", device="cuda")  # type: ignore[arg-type]
    says_why(str(refused.value))
    with pytest.raises(wc.CollectiveError) as refused:
        CollectiveReceiver(None, "run", "127.0.0.1:1", device="cuda:0")  # type: ignore[arg-type]
    says_why(str(refused.value))


def test_an_actor_on_cuda_is_refused_at_config_time():
    with pytest.raises(ValueError, match="actor.weights_group on device 'cuda:1'") as refused:
        ActorConfig(weights_group=True, device="cuda:1")
    says_why(str(refused.value))
    ActorConfig(weights_group=True, device="cpu")
    ActorConfig(weights_group=False, device="cuda:1")
    with pytest.raises(ValueError, match="NCCL watchdog"):
        load_config(["actor.weights_group=true", "actor.device=cuda"])


class Reached(Exception):
    """The learner got past the refusal to its process group."""


def test_a_learner_that_would_run_on_cuda_is_refused_before_its_process_group(monkeypatch):
    """learner.loop.run with CUDA available (mocked): it exits with the reason before
    init_from_env (the process group) and so before the model loads; without CUDA, or without
    the weights group, it goes on."""

    def reached(*_args, **_kwargs):
        raise Reached

    monkeypatch.setattr(learner_loop, "init_from_env", reached)
    monkeypatch.setattr(torch, "set_num_threads", lambda _n: None)  # run() sets it next
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(["learner.weights_group=true"])
    with pytest.raises(SystemExit) as refused:
        learner_loop.run(cfg)
    message = str(refused.value)
    assert message.startswith("specrl-learner: refusing to start: learner.weights_group:")
    says_why(message)
    with pytest.raises(Reached):
        learner_loop.run(load_config(["learner.weights_group=false"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Reached):  # gloo on CPU: allowed
        learner_loop.run(cfg)
