"""Actors blocked on submit at the GPU profile's pipeline ratios, scaled down: real GroupSenders
and a real GroupReceiver over ZeroMQ on 127.0.0.1, a learner that takes a step's groups at once
and then trains (sleeps) while the actors go on finishing groups.

The GPU profile aims at 512 completions per step and 256 per generate call (64 and 32 groups of
8); here both are halved and two actors each finish a group every ``GROUP_EVERY_S``. The learner
keeps up on average (a step's groups take ``TRAIN_S`` to train, less than the actors need to make
them), so with the profile's queue and outboxes (:func:`pipeline_sizes`) the actors should
(almost) never wait. With the old defaults (4 and 4) every step's burst fills the queue and both
outboxes and the actors wait: the control that shows the measurement can fail.
"""

from __future__ import annotations

import threading
import time

import pytest

from common import metric_names as mn
from common.config.gpu_profile import pipeline_sizes
from common.link.send.sender import GroupSender
from testing.transport import make_group, start_receiver

pytestmark = pytest.mark.integration

GROUPS_PER_STEP = 32  # the profile's 64, halved
PROMPTS_PER_CALL = 16  # the profile's 32, halved
ACTORS = 2
GROUP_EVERY_S = 0.025  # per actor: 80 groups/s together
TRAIN_S = 0.3  # 32 groups per 0.3 s: 107 groups/s, faster than the actors on average
STEPS = 8


def blocked_fraction(queue_max: int, outbox_max: int) -> float:
    """Share of the actors' time spent waiting in ``submit`` over ``STEPS`` learner steps."""
    receiver = start_receiver(queue_max=queue_max)
    stop = threading.Event()
    senders = [
        GroupSender(receiver.bound_address, f"actor-{i}", outbox_max=outbox_max).start()
        for i in range(ACTORS)
    ]

    def actor(sender: GroupSender, offset: int) -> None:
        tag = offset
        next_at = time.monotonic()
        while not stop.is_set():
            # A call of PROMPTS_PER_CALL groups, each submitted as soon as its rows finish.
            for _ in range(PROMPTS_PER_CALL):
                next_at = max(next_at + GROUP_EVERY_S, time.monotonic())
                time.sleep(max(0.0, next_at - time.monotonic()))
                while not stop.is_set():
                    try:
                        sender.submit(make_group(tag), timeout_s=0.5)
                        break
                    except TimeoutError:
                        continue
                tag += 1

    threads = [
        threading.Thread(target=actor, args=(s, 1000 * i), daemon=True)
        for i, s in enumerate(senders)
    ]
    try:
        for t in threads:
            t.start()
        start = time.monotonic()
        for _ in range(STEPS):
            taken = 0
            while taken < GROUPS_PER_STEP:
                if receiver.intake.get(timeout_s=10.0) is None:
                    raise AssertionError("the actors stopped sending")
                taken += 1
            time.sleep(TRAIN_S)  # the step trains; the receiver acks only while its queue has room
        wall = time.monotonic() - start
        blocked = [s.stats()[mn.SENDER_SUBMIT_BLOCKED_S] for s in senders]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5.0)
        for s in senders:
            s.close(timeout_s=0.0)
        receiver.close()
    return sum(blocked) / (ACTORS * wall)


def test_actors_rarely_wait_with_the_gpu_profiles_queue_and_outbox():
    queue_max, outbox_max = pipeline_sizes(GROUPS_PER_STEP, PROMPTS_PER_CALL)
    assert (queue_max, outbox_max) == (GROUPS_PER_STEP, PROMPTS_PER_CALL)
    sized = blocked_fraction(queue_max, outbox_max)
    old = blocked_fraction(4, 4)  # the CPU defaults: the control
    assert sized < 0.10, f"actors blocked {sized:.1%} of the time with the profile's sizes"
    assert old > 0.10, f"the control (queue 4, outbox 4) blocked only {old:.1%}"
