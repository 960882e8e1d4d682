"""The pipeline across hosts: network namespaces this test makes (testing/netns.py), the learner and
a password-protected Redis on one, two actors on two others, each actor joined to the learner's
host by its own link with a non-loopback address, CurveZMQ on with keys from ``specrl keys`` (each
actor host holding only the learner's public key and its own pair), and each actor host with its
own weights cache (so each fetches versions from Redis over its link). Mid-run, one actor's link
is cut for some seconds and healed. Checked with the ledger: both actors trained on, nothing
lost, nothing trained twice, the partitioned actor trained on again after the heal, and the
learner listening on its configured address only.

Where namespaces cannot be made (no root, no iproute2, a kernel or container that refuses them)
the test is skipped with the banner ``SPECRL-MULTIHOST: SKIPPED: <reason>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import metric_names as mn
from ops import processes
from ops.ledger import Ledger, read_ledger
from ops.metrics_file import read_metrics
from ops.processes import ROOT
from ops.redis_server import RedisServer
from testing import netns
from testing.netns import LEARNER_IP, Hosts, NetnsProcess
from testing.pipeline import warm_model

pytestmark = pytest.mark.integration

LEARNER_PORT = 5555  # the namespaces are private: fixed ports cannot clash with anything
REDIS_PORT = 6379
PARTITION_S = 8.0
DELAY_MS = 20
ACTORS = ("host-a0", "host-a1")
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def hosts():
    reason = netns.unavailable()
    if reason is not None:
        banner = f"SPECRL-MULTIHOST: SKIPPED: {reason}"
        print(f"\n{'=' * len(banner)}\n{banner}\n{'=' * len(banner)}", file=sys.__stderr__)
        pytest.skip(banner)
    with Hosts.create(actors=len(ACTORS)) as made:
        yield made


def actor_keys_dir(keys: Path, name: str, dest: Path) -> Path:
    """What an actor host is given: the learner's public key and its own pair, nothing else."""
    dest.mkdir(mode=0o700)
    for file in ("learner.key", f"{name}.key", f"{name}.key_secret"):
        shutil.copy2(keys / file, dest / file)
    return dest


def trained_by(ledger: Ledger, name: str, after_step: int = -1) -> int:
    return sum(
        r["actor_id"].startswith(f"{name}-") and r["step"] > after_step for r in ledger.trained
    )


def wait_for(cond, what: str, procs: list[processes.Process]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        for proc in procs:
            assert proc.poll() is None, f"{proc.name} died:\n{proc.log_tail()}"
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{procs[0].log_tail()}")
        time.sleep(0.25)


def test_learner_and_two_actors_on_separate_hosts_through_a_partition(hosts, tmp_path):
    model_dir = warm_model(tmp_path / "model")
    keys = tmp_path / "keys"
    specrl = Path(sys.executable).with_name("specrl")
    subprocess.run(
        [str(specrl), "keys", str(keys), *(f"--actor={a}" for a in ACTORS)], check=True, timeout=60
    )
    delay_refused = hosts.delay(1, DELAY_MS)  # optional: kernels without sch_netem refuse it
    if delay_refused:
        print(f"netem delay not applied: {delay_refused}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    password = "multihost-" + os.urandom(8).hex()
    env = {"SPECRL_REDIS_PASSWORD": password}  # never on a command line
    common = [
        f"run.name=multihost-{os.getpid()}",
        f"run.dir={run_dir}",
        "run.steps=100000",  # stopped by the test once it has seen what it checks
        "run.ledger=true",
        f"redis.url=redis://{LEARNER_IP}:{REDIS_PORT}/0",
        f"model.path={model_dir}",
        f"learner.address=tcp://{LEARNER_IP}:{LEARNER_PORT}",
        "learner.metrics_port=-1",
        "actor.metrics_port=-1",
        "actor.heartbeat_interval_s=0.5",
        "actor.resend_timeout_s=3",
    ]
    redis_server = RedisServer(port=REDIS_PORT, password=password, bind=LEARNER_IP)
    learner = NetnsProcess(
        hosts.learner,
        processes.learner(run_dir, [*common, f"security.curve_dir={keys}"], ROOT, env),
    )
    actors = []
    for i, name in enumerate(ACTORS):
        own = [
            f"security.curve_dir={actor_keys_dir(keys, name, tmp_path / f'keys-{name}')}",
            f"security.actor_key={name}",
            f"actor.actor_id={name}",
            f"redis.host_cache_dir={tmp_path / f'cache-{name}'}",
        ]
        actors.append(
            NetnsProcess(hosts.actors[i], processes.actor(run_dir, i, [*common, *own], env, ROOT))
        )
    procs = [learner, *actors]
    try:
        with netns.entered(hosts.learner):
            redis_server.start()
        learner.start()
        for actor in actors:
            actor.start()

        def trained(name: str, after: int = -1) -> int:
            return trained_by(read_ledger(run_dir), name, after)

        wait_for(lambda: all(trained(a) for a in ACTORS), "groups of both actors trained", procs)
        assert netns.listening(learner.pid) == {(LEARNER_IP, LEARNER_PORT)}

        assert netns.reachable(hosts.actors[1], LEARNER_IP, REDIS_PORT)
        hosts.partition(1)
        try:
            assert not netns.reachable(hosts.actors[1], LEARNER_IP, REDIS_PORT)
            assert netns.reachable(hosts.actors[0], LEARNER_IP, REDIS_PORT)
            time.sleep(PARTITION_S)
        finally:
            hosts.heal(1)
        # Groups of the step being assembled at the heal may predate it: count from the next.
        steps = read_metrics(run_dir / "metrics.jsonl")
        healed_at = max((r[mn.LEARNER_STEP] for r in steps if mn.LEARNER_STEP in r), default=0) + 1
        wait_for(
            lambda: trained(ACTORS[1], healed_at) and trained(ACTORS[0], healed_at),
            "both actors trained on after the partition healed",
            procs,
        )
    finally:
        codes = processes.stop_all(actors, 60) | processes.stop_all([learner], 60)
        redis_server.close()
    assert codes == {"actor-0": 0, "actor-1": 0, "learner": 0}, codes

    ledger = read_ledger(run_dir)
    assert not ledger.lost(), sorted(ledger.lost())[:10]
    assert not ledger.duplicated(), sorted(ledger.duplicated())[:10]
    assert not ledger.unknown(), sorted(ledger.unknown())[:10]
    assert {r["actor_id"].rsplit("-", 1)[0] for r in ledger.trained} == set(ACTORS)
    # The actors reached the learner and Redis over their links, with their own keys.
    for i, name in enumerate(ACTORS):
        text = actors[i].log_tail(400)
        assert f"actor {name}-" in text and f"learner tcp://{LEARNER_IP}:{LEARNER_PORT}" in text


def test_stale_namespaces_of_a_dead_run_are_removed_and_live_ones_kept(hosts):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-1-L"
    netns.ip("netns", "add", stale)
    try:
        assert netns.remove_stale() == [stale]
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)
    listed = netns.ip("netns", "list")
    assert stale not in listed
    assert all(name in listed for name in (hosts.learner, *hosts.actors))


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda _: None)
    reason = netns.unavailable()
    assert reason is not None
    assert ("root" if os.geteuid() != 0 else "iproute2") in reason
