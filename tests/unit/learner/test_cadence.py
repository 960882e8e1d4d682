"""The learner's publish and checkpoint cadence: one rule for rank 0 and the other ranks."""

from common.config import load_config
from learner.loop import Cadence, cadence


def test_publish_every_n_steps_unless_skipped_and_checkpoint_every_m() -> None:
    cfg = load_config(["learner.publish_every=2", "learner.checkpoint_every=3"])
    due = [cadence(cfg, step, skipped=False) for step in range(1, 7)]
    assert [d.publish for d in due] == [False, True, False, True, False, True]
    assert [d.checkpoint for d in due] == [False, False, True, False, False, True]
    # A skipped step publishes nothing (no new version), but the checkpoint stays on its beat.
    assert cadence(cfg, 6, skipped=True) == Cadence(publish=False, checkpoint=True)
