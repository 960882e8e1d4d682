"""The whole pipeline as separate processes: real Redis, real ZeroMQ sockets, learner + 2 actors."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import redis
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common import metric_names as mn
from common.link.send.sender import GroupSender
from common.weights.store import WeightStore
from learner.checkpoint import latest_checkpoint
from ops.cli import main as cli_main
from ops.ledger import read_ledger
from testing.groups import make_groups
from testing.pipeline import Pipeline, wait_exit, warm_model

pytestmark = pytest.mark.integration

STEPS = 100
MAX_STALENESS = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"))


def scrape_while_running(run_dir, roles, timeout_s: float = 180.0) -> dict[str, dict[str, float]]:
    """Each role's /metrics (port from run_dir/prometheus/), once it shows a trained step."""
    out: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(roles):
        assert time.monotonic() < deadline, (
            f"no /metrics with progress from {set(roles) - set(out)}"
        )
        for role in roles:
            port_file = run_dir / "prometheus" / f"{role}.port"
            if role in out or not port_file.is_file():
                continue
            try:
                port = int(port_file.read_text())
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except (OSError, ValueError):
                continue
            values = {
                s.name: s.value
                for family in text_string_to_metric_families(text.decode())
                for s in family.samples
                if not s.labels or "actor_id" in s.labels
            }
            if (
                values.get("specrl_learner_step", 0) >= 2
                or values.get("specrl_actor_groups_sent_total", 0) >= 1
            ):
                out[role] = values
        time.sleep(0.5)
    return out


def test_learner_and_two_actors(tmp_path, redis_server, model_dir):
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        model_dir,
        [
            f"run.steps={STEPS}",
            f"learner.max_staleness={MAX_STALENESS}",
            "learner.checkpoint_every=40",
            "learner.lr=5e-4",
        ],
    )
    try:
        learner = pipeline.start(actors=2)
        scraped = scrape_while_running(tmp_path, ["learner", "actor-0", "actor-1"])
        code = wait_exit(learner, 400, pipeline)
        assert code == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    for i, actor in enumerate(pipeline.actors):
        assert actor.returncode == 0, pipeline.log_tail(f"actor-{i}")

    steps = pipeline.steps()
    assert len(steps) == STEPS
    # Every key the run wrote is one the registry defines.
    unknown = {k for r in steps for k in r if "/" in k and not mn.is_known(k)}
    assert not unknown, sorted(unknown)
    # Prometheus: every process served /metrics while it ran.
    assert scraped["learner"]["specrl_learner_version"] >= 1
    assert scraped["learner"]["specrl_learner_groups_received_total"] >= 1
    for actor in ("actor-0", "actor-1"):
        assert scraped[actor]["specrl_actor_groups_sent_total"] >= 1

    # Versions advance: one publish per step, starting from version 0 at start-up.
    versions = [r["learner/version"] for r in steps]
    assert versions == list(range(1, STEPS + 1))
    store = WeightStore(redis.Redis.from_url(redis_server.url), pipeline.run_name)
    assert store.latest_version() == STEPS

    # Both actors contributed and were seen alive.
    ledger = read_ledger(tmp_path)
    assert len({actor for actor, _ in ledger.submitted}) == 2
    assert max(r["actor/live"] for r in steps) == 2

    # The staleness bound holds for every trained group.
    assert ledger.trained, "nothing was trained"
    assert all(r["learner_version"] - r["version"] <= MAX_STALENESS for r in ledger.trained)
    assert max(r["learner/staleness_max"] for r in steps) <= MAX_STALENESS

    # Exactly once: nothing consumed twice, nothing consumed that was not sent, and whatever was
    # sent but not consumed is still unacked in its actor's outbox (not lost in between).
    duplicates = {k: n for k, n in ledger.consumed.items() if n > 1}
    assert not duplicates
    assert all(n == 1 for n in ledger.submitted.values())
    assert set(ledger.consumed) <= set(ledger.submitted)
    missing = set(ledger.submitted) - set(ledger.consumed)
    accounted = ledger.unacked_at_exit | ledger.pending_at_exit
    assert missing <= accounted, sorted(missing - accounted)[:10]
    assert sum(r["learner/groups"] for r in steps) == sum(
        1 for o in ledger.outcomes.values() if o == "trained"
    )

    # Reward rises on the built-in task within the budget.
    rewards = [r["learner/reward_mean"] for r in steps]
    quarter = STEPS // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first + 0.05, f"reward did not rise: first quarter {first:.3f}, last {last:.3f}"

    # HF-format checkpoint at exit.
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None and (ckpt / "config.json").is_file()
    assert (ckpt / "model.safetensors").is_file()


def test_learner_restart_resumes_and_versions_keep_growing(tmp_path, redis_server, model_dir):
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        model_dir,
        # One group per step from batches of 4: when the learner stops after step 6, the rest of
        # the batch that step 6 came from is acked and queued, so the first learner exits with
        # groups in hand (carried in its checkpoint) whatever the machine's load.
        [
            "run.steps=6",
            "learner.checkpoint_every=3",
            "learner.groups_per_step=1",
            "actor.prompts_per_batch=4",
        ],
    )
    try:
        learner = pipeline.start_learner()
        pipeline.start_actor(0)
        assert wait_exit(learner, 240, pipeline) == 0, pipeline.log_tail("learner")
        first_run = pipeline.steps()
        assert first_run[-1]["learner/version"] == 6
        # Restart the learner with a larger budget: it resumes at step 6 and versions go on.
        learner = pipeline.start_learner(["run.steps=10"])
        assert wait_exit(learner, 240, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    steps = pipeline.steps()
    resumed = steps[len(first_run) :]
    assert [r["learner/step"] for r in resumed] == [7, 8, 9, 10]
    # On restart the learner republishes its weights as 7, then one version per step.
    assert [r["learner/version"] for r in resumed] == [8, 9, 10, 11]
    ledger = read_ledger(tmp_path)
    assert not {k: n for k, n in ledger.consumed.items() if n > 1}
    # Groups acked by the first learner but not trained were carried in its checkpoint and
    # consumed (trained, or dropped as stale) by the second: nothing acked is lost.
    rows = [json.loads(x) for x in (tmp_path / "ledger" / "learner.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "outcome" in r]
    start = next(i for i, r in enumerate(rows) if r["outcome"] == "pending_at_exit")
    end = start
    while end < len(rows) and rows[end]["outcome"] == "pending_at_exit":
        end += 1  # the first learner's exit block
    carried = {(r["actor_id"], r["seq"]) for r in rows[start:end]}
    consumed_later = {
        (r["actor_id"], r["seq"]) for r in rows[end:] if r["outcome"] in ("trained", "stale")
    }
    assert carried, "the first learner had nothing in flight; the check would be vacuous"
    assert carried <= consumed_later


@pytest.fixture(scope="module")
def scratchpad_model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("scratchpad-model"), task="scratchpad")


@pytest.mark.parametrize("mode", ["verify_on_swap", "verify_on_finish", "abort", "keep"])
def test_pipeline_in_each_inflight_mode(tmp_path, redis_server, scratchpad_model_dir, mode):
    # Long rollouts (the scratchpad task: 60-110 tokens a completion) so that decoding fills most
    # of an actor's time and versions land mid-rollout whatever the machine's speed; a small
    # learning rate so consecutive versions barely differ (what the salvage check below assumes).
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        scratchpad_model_dir,
        [
            "task=scratchpad",
            "run.steps=8",
            f"actor.inflight={mode}",
            "learner.groups_per_step=2",
            "learner.max_staleness=3",
            "learner.lr=1e-5",
        ],
    )
    pipeline.run_to_end(actors=1, timeout_s=300)
    steps = pipeline.steps()
    assert [r["learner/version"] for r in steps] == list(range(1, 9))
    swapped = [r for r in steps if r.get("verify/swaps")]
    assert swapped, f"no weight update reached a rollout in flight ({mode})"
    ledger = read_ledger(tmp_path)
    assert not {k: n for k, n in ledger.consumed.items() if n > 1}
    if mode == "keep":
        return  # nothing is verified: no token is salvaged or wasted
    # Per step: the actors' per-batch counters, averaged over the step's groups. A swap comes
    # after the prefill, so every swap has tokens in flight.
    inflight = sum(r["verify/inflight_tokens"] for r in swapped)
    salvaged = sum(r["verify/salvaged_tokens"] for r in swapped)
    assert inflight > 0, f"swaps counted without tokens in flight ({mode})"
    for r in swapped:
        assert r["verify/salvaged_tokens"] <= r["verify/inflight_tokens"], r
    if mode == "abort":
        assert salvaged == 0 and all(r["verify/salvaged_frac"] == 0 for r in swapped)
    else:
        # Consecutive versions of the warm-started model barely differ, so delayed verification
        # keeps nearly every token (README: 97% in the default run); a verifier that compared
        # the wrong log-probs, or cut every row, would keep few.
        assert salvaged / inflight > 0.5, (salvaged, inflight)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypted_pipeline_and_a_keyless_sender_gets_nothing_through(
    tmp_path, redis_server, model_dir
):
    keys = tmp_path / "keys"
    assert cli_main(["keys", str(keys)]) == 0
    pipeline = Pipeline.make(
        tmp_path / "run", redis_server.url, model_dir, ["run.steps=4", f"security.curve_dir={keys}"]
    )
    (tmp_path / "run").mkdir()
    address = next(o for o in pipeline.overrides if o.startswith("learner.address=")).split("=", 1)[
        1
    ]
    try:
        learner = pipeline.start_learner()
        # A sender without the learner's key: its frames never reach the learner.
        intruder = GroupSender(address, "intruder", resend_timeout_s=60.0).start()
        group = make_groups(45)[0]
        group.actor_id = ""
        intruder.submit(group, timeout_s=5.0)
        pipeline.start_actor(0)
        assert wait_exit(learner, 240, pipeline) == 0, pipeline.log_tail("learner")
        assert intruder.unacked() == 1 and intruder.acked_total == 0
        intruder.close(timeout_s=0.0)
    finally:
        pipeline.stop_all()
    steps = pipeline.steps()
    assert [r["learner/version"] for r in steps] == [1, 2, 3, 4]
    ledger = read_ledger(tmp_path / "run")
    assert all(actor != "intruder" for actor, _ in ledger.consumed)


def test_actors_take_versions_from_the_weights_group_and_from_redis_in_one_run(
    tmp_path, redis_server, model_dir
):
    """learner.weights_group: actor 0 joins the learner's weights group and receives versions as
    broadcast buckets; actor 1 keeps the Redis path. Both serve one run to its end."""
    from ops.redis_server import find_free_port

    address = f"127.0.0.1:{find_free_port()}"
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        model_dir,
        ["run.steps=30", "learner.weights_group=true", f"learner.weights_group_address={address}"],
    )
    group_versions = 0.0
    try:
        learner = pipeline.start_learner()
        pipeline.start_actor(0, ["actor.weights_group=true"])
        pipeline.start_actor(1)
        deadline = time.monotonic() + 240
        while group_versions < 2 and learner.poll() is None:
            assert time.monotonic() < deadline, pipeline.log_tail("actor-0")
            group_versions = scrape_actor(tmp_path, "actor-0", "weight_versions_collective")
            time.sleep(0.5)
        assert wait_exit(learner, 240, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    assert group_versions >= 2, pipeline.log_tail("actor-0")
    steps = pipeline.steps()
    assert [r["learner/version"] for r in steps] == list(range(1, 31))
    ledger = read_ledger(tmp_path)
    assert len({actor for actor, _ in ledger.consumed}) == 2  # both actors' groups trained
    assert not ledger.lost() and not {k: n for k, n in ledger.consumed.items() if n > 1}


def scrape_actor(run_dir, role: str, suffix: str) -> float:
    """``specrl_actor_<suffix>`` from ``role``'s /metrics (0 until it answers)."""
    port_file = run_dir / "prometheus" / f"{role}.port"
    try:
        port = int(port_file.read_text())
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except (OSError, ValueError):
        return 0.0
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name in (f"specrl_actor_{suffix}", f"specrl_actor_{suffix}_total"):
                return s.value
    return 0.0
