"""The learner takes held-out figures (``eval/*``) from the evaluating actor only, and never a
version above its own: a forged heartbeat can neither write its figures into the records nor
hide the real evaluations behind a huge ``eval/version``."""

from __future__ import annotations

from common import metric_names as mn
from common.link.receive.intake import ActorInfo
from learner.loop import EvaluationIntake


def actor(actor_id: str, version: float | None = None, reward: float = 0.5) -> ActorInfo:
    stats = {mn.ACTOR_TOKENS_PER_S: 10.0}
    if version is not None:
        stats |= {mn.EVAL_VERSION: version, mn.EVAL_AVG_REWARD: reward}
    return ActorInfo(actor_id, 0, 0.0, stats, groups=1, heartbeats=1)


def live(*actors: ActorInfo) -> dict[str, ActorInfo]:
    return {a.actor_id: a for a in actors}


def test_each_evaluation_of_the_evaluating_actor_is_taken_once() -> None:
    intake = EvaluationIntake()
    assert intake.take(live(actor("host-1-aa"), actor("host-0-bb")), 3) == {}
    got = intake.take(live(actor("host-1-aa"), actor("host-0-bb", 2, 0.25)), 3)
    assert got == {mn.EVAL_VERSION: 2, mn.EVAL_AVG_REWARD: 0.25}
    assert intake.take(live(actor("host-1-aa"), actor("host-0-bb", 2, 0.25)), 3) == {}
    got = intake.take(live(actor("host-0-bb", 4, 0.5)), 4)
    assert got[mn.EVAL_VERSION] == 4 and intake.refused == 0


def test_a_version_above_the_learners_own_is_refused_and_hides_nothing() -> None:
    intake = EvaluationIntake()
    forged = actor("forger-cc", 1e9, 1.0)
    assert intake.take(live(forged), 5) == {}
    assert intake.refused == 1 and intake.actor_id is None  # nor does it become the evaluator
    # The real evaluation that follows is taken.
    got = intake.take(live(forged, actor("host-0-bb", 5, 0.3)), 5)
    assert got == {mn.EVAL_VERSION: 5, mn.EVAL_AVG_REWARD: 0.3}
    assert intake.actor_id == "host-0-bb"


def test_another_actors_figures_are_refused_while_the_evaluator_is_live() -> None:
    intake = EvaluationIntake()
    real = actor("host-0-bb", 2, 0.25)
    assert intake.take(live(real), 2)[mn.EVAL_AVG_REWARD] == 0.25
    # An actor that joins later with a newer (in range) evaluation is not taken.
    forged = actor("host-1-aa", 3, 1.0)
    for _ in range(3):
        assert intake.take(live(real, forged), 3) == {}
    assert intake.refused == 1  # counted once, not every step
    got = intake.take(live(forged, actor("host-0-bb", 3, 0.4)), 3)
    assert got == {mn.EVAL_VERSION: 3, mn.EVAL_AVG_REWARD: 0.4}
    # The evaluator forgotten (restarted with a fresh id): its successor's figures are taken.
    got = intake.take(live(actor("host-0-dd", 4, 0.5)), 4)
    assert got[mn.EVAL_AVG_REWARD] == 0.5 and intake.actor_id == "host-0-dd"
