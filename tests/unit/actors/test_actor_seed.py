"""Which seed an actor draws its prompts and samples from: one per index by default, or
``actor.seed`` (what docker/actor.sh sets from the container id, since compose replicas share one
command and so one index)."""

from actors.wiring import actor_seed
from common.config import load_config


def test_default_seed_is_one_per_index_and_run_seed():
    seeds = {
        actor_seed(load_config([f"actor.index={i}", f"run.seed={s}"]))
        for i in range(3)
        for s in range(2)
    }
    assert len(seeds) == 6


def test_explicit_seed_wins_over_the_index():
    a = actor_seed(load_config(["actor.index=0", "actor.seed=123456789"]))
    b = actor_seed(load_config(["actor.index=0", "actor.seed=987654321"]))
    assert (a, b) == (123456789, 987654321)
    assert actor_seed(load_config(["actor.index=5", "actor.seed=0"])) == 0
