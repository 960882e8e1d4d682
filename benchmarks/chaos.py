"""Chaos run: the real pipeline under the faults a cluster inflicts, with an exactly-once ledger.

    python -m benchmarks.chaos [--quick] [--json PATH]

Starts a private Redis, a learner and two actors as OS processes (CurveZMQ on, with an allow-list
of the actors' keys; ``run.ledger=true``), lets training run, and injects in turn:

1. ``actor_sigkill``: an actor is SIGKILLed while the learner is frozen (so its outbox and spool
   hold unacked groups) and restarted under the same name;
2. ``learner_sigkill``: the learner is SIGKILLed (no clean exit, no final checkpoint) and
   restarted; it resumes from its checkpoint plus the write-ahead log;
3. ``redis_restart``: Redis is stopped and started again empty (no persistence); the learner
   republishes, actors keep their weights meanwhile;
4. ``bad_frame_flood``: an authenticated peer sends every kind of invalid frame (garbage,
   truncated, oversized, wrong version, wrong type, NaN, out-of-vocab, forged identity, an ack);
5. ``poisoned_frames``: the same peer sends well-formed groups that no learner may train on
   (rewards that overflow float32, versions ahead of the learner or beyond int64, groups longer
   than the model's context or of the wrong size, frames of many tiny objects); refused ones must
   come back refused, the rest be counted as bad, and the policy stay finite;
6. ``unauthenticated_sender``: senders with an unlisted key, with the wrong learner key and
   without CURVE try to push groups;
7. ``learner_unreachable``: the learner is frozen (SIGSTOP) for a minute (15 s with --quick);
8. ``network_partition``: actor 1's host is cut off from the learner's host (its link taken down,
   Redis unreachable too) for 20 s (8 s with --quick), then healed; it must be trained on again.

The processes run on hosts made of network namespaces (testing/netns.py: the learner, Redis and
this script on one, each actor on its own, non-loopback addresses inside them). Where namespaces
cannot be made (no root or iproute2) everything runs on loopback and the partition is skipped,
said in a ``SPECRL-CHAOS: network_partition SKIPPED: <reason>`` banner and in the figures.

Then it stops everything cleanly and reads the ledger (ops/ledger.py): every ``(actor_id,
seq)`` an actor produced must be consumed exactly once (trained, or dropped as stale), or be
accounted for as still unacked in a stopped actor's spool or carried in the learner's final
checkpoint. Also checked: the learner counted exactly the bad frames sent and the poisoned
groups refused, refused the unauthenticated senders, never crashed on its own, kept its policy
finite, and versions never went backwards.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import torch
import zmq

from benchmarks import cli
from common import metric_names as mn
from common.config import load_config
from common.curve_keys import CurveKeys, actor_keys, learner_keys
from common.link.protocol import (
    Ack,
    TrajectoryGroup,
    encode,
)
from common.link.send.sender import GroupSender
from common.link.transport import connect_dealer
from common.model import load_pretrained
from learner.checkpoint import latest_checkpoint
from learner.prepare.warm_start import ensure_model
from ops import processes
from ops.keys import write_keys
from ops.ledger import read_ledger
from ops.metrics_file import read_metrics
from ops.processes import ROOT
from ops.redis_server import RedisServer, find_free_port
from testing import netns
from testing.hostile import (
    poisoned_frames,
    refused_seqs,
    replies,
    send_when_connected,
    valid_group,
)

FLOOD_ID = "flooder"
STOP_GRACE_S = 60.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Cluster:
    """The processes of one run (ops/processes.py), with restarts and a count of unplanned exits."""

    def __init__(
        self, run_dir: Path, overrides: list[str], env: dict, hosts: netns.Hosts | None
    ) -> None:
        self.run_dir = run_dir
        self.hosts = hosts
        self.learner = processes.learner(run_dir, overrides, ROOT, env)
        self.actors = {i: processes.actor(run_dir, i, overrides, env, ROOT) for i in (0, 1)}
        if hosts is not None:  # each on its own host, with its own weights cache
            self.learner = netns.NetnsProcess(hosts.learner, self.learner)
            for i, proc in self.actors.items():
                proc.args.append(f"redis.host_cache_dir={run_dir.parent / f'cache-{i}'}")
                self.actors[i] = netns.NetnsProcess(hosts.actors[i], proc)
        self.learner_crashes_unplanned = 0
        self.actor_crashes_unplanned = 0

    def check(self) -> None:
        """Restart anything that died on its own (and count it: the run must have none)."""
        if self.learner.poll() is not None:
            self.learner_crashes_unplanned += 1
            log(f"UNPLANNED: learner exited with {self.learner.returncode}; restarting")
            self.learner.start()
        for index, proc in self.actors.items():
            if proc.poll() is not None:
                self.actor_crashes_unplanned += 1
                log(f"UNPLANNED: actor {index} exited with {proc.returncode}; restarting")
                proc.start()

    def stop(self) -> dict[str, int | None]:
        """SIGTERM actors first (they flush and record what is unacked), then the learner."""
        codes = processes.stop_all(self.actors.values(), STOP_GRACE_S)
        return codes | processes.stop_all([self.learner], STOP_GRACE_S)


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if mn.LEARNER_STEP in r]


def wait_steps(cluster: Cluster, n_more: int, timeout_s: float) -> None:
    """Wait until the learner has logged ``n_more`` more step records (restarting crashes)."""
    target = len(steps(cluster.run_dir)) + n_more
    deadline = time.monotonic() + timeout_s
    while len(steps(cluster.run_dir)) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no progress to {target} step records in {timeout_s:.0f} s")
        cluster.check()
        time.sleep(0.25)


def sleep_checking(cluster: Cluster, seconds: float, learner_frozen: bool = False) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for index, proc in cluster.actors.items():
            if proc.poll() is not None:
                raise RuntimeError(f"actor {index} died (exit {proc.returncode})")
        if not learner_frozen:
            cluster.check()
        time.sleep(0.25)


# ---------------------------------------------------------------------------------- bad frames


def _group(actor_id: str = FLOOD_ID) -> TrajectoryGroup:
    """A valid one-completion group of three tokens, the base every bad frame breaks."""
    return valid_group(actor_id, 0, 1, completion_len=3)


def _mutated(mutate) -> bytes:
    """A valid group's wire map with one field broken (``encode`` would refuse to make it)."""
    wire = msgpack.unpackb(encode(_group()), raw=False)
    mutate(wire)
    return msgpack.packb(wire, use_bin_type=True)


def bad_frames(vocab: int) -> list[tuple[str, list[bytes]]]:
    """(kind, frames) of every sort of invalid input; each frame must be rejected once."""
    valid = encode(_group())
    nan = np.array([-0.1, math.nan, -0.3], dtype=np.float32).tobytes()
    out_of_vocab = np.array([1, vocab + 7, 3], np.int32).tobytes()
    rng = np.random.default_rng(0)

    def set_completion(key, value):
        return lambda w: w["completions"][0].__setitem__(key, value)

    return [
        ("garbage", [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (1, 17, 4096)]),
        ("truncated", [valid[: len(valid) // 2], valid[:-1]]),
        (
            "oversized",
            # More completions than the learner's decode bound (twice the group size), in a
            # frame small enough to reach the decoder (larger ones libzmq drops unread).
            [_mutated(lambda w: w.__setitem__("completions", w["completions"] * 100))],
        ),
        ("wrong_version", [_mutated(lambda w: w.__setitem__("v", 99))]),
        (
            "wrong_type",
            [_mutated(lambda w: w.__setitem__("type", "weights")), msgpack.packb([1, 2])],
        ),
        ("nan", [_mutated(set_completion("behaviour_logprobs", nan))]),
        ("out_of_vocab", [_mutated(set_completion("token_ids", out_of_vocab))]),
        ("length_mismatch", [_mutated(set_completion("token_versions", b"\x00" * 4))]),
        ("forged_identity", [encode(_group("someone-else"))]),
        ("ack_to_learner", [encode(Ack(actor_id=FLOOD_ID, seqs=[0]))]),
        ("multipart", [b""]),  # sent as two frames: a bad envelope
    ]


def flood(address: str, keys: CurveKeys, vocab: int, repeat: int) -> dict[str, int]:
    """Send every bad frame ``repeat`` times from an authenticated peer; returns counts sent."""
    dealer = _flood_dealer(address, keys)
    sent: dict[str, int] = {}
    try:
        for kind, frames in bad_frames(vocab):
            for _ in range(repeat):
                for frame in frames:
                    parts = [b"part-1", b"part-2"] if kind == "multipart" else [frame]
                    send_when_connected(dealer, parts)
                    sent[kind] = sent.get(kind, 0) + 1
        # Nothing must come back: rejected frames are never acked.
        if dealer.poll(1000):
            raise AssertionError(f"the learner answered a bad frame: {dealer.recv()!r:.100}")
    finally:
        dealer.close(linger=0)
    return sent


def poison(
    address: str, keys: CurveKeys, group_size: int, context: int, run_dir: Path
) -> dict[str, int]:
    """Send every poisoned kind (testing/hostile.py) from an authenticated peer; refused ones
    must come back in an ack's ``refused`` map with their reason, the others get no answer."""
    latest = max((r[mn.LEARNER_VERSION] for r in steps(run_dir)), default=0)
    poisons = poisoned_frames(FLOOD_ID, group_size, context, latest, first_seq=1_000_000)
    want = {p.seq: p.reason for p in poisons if p.verdict == "refused"}
    dealer = _flood_dealer(address, keys)
    try:
        for p in poisons:
            send_when_connected(dealer, [p.frame])
        acks = replies(dealer, lambda acks: len(refused_seqs(acks)) >= len(want), 60)
    finally:
        dealer.close(linger=0)
    if any(a.seqs for a in acks):
        raise AssertionError(f"a poisoned group was acked as taken: {acks}")
    got = refused_seqs(acks)
    return {
        "sent": len(poisons),
        "refused_sent": len(want),
        "refused_acked": sum(got.get(s) == r for s, r in want.items()),
        "bad_sent": sum(p.verdict == "bad" for p in poisons),
    }


def policy_finite(run_dir: Path) -> bool:
    """Every tensor of the newest checkpoint's policy is finite."""
    model = load_pretrained(latest_checkpoint(run_dir / "checkpoints"))
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values())


def _flood_dealer(address: str, keys: CurveKeys) -> zmq.Socket:
    """The authenticated (buggy or hostile) peer's socket."""
    return connect_dealer(
        address,
        FLOOD_ID.encode(),
        curve_secret_key=keys.secret,
        curve_public_key=keys.public,
        curve_server_key=keys.server_public,
    )


def unauthenticated(address: str, keys_dir: Path, cluster: Cluster) -> dict:
    """Senders the learner must refuse: an unlisted key, a wrong learner key, no CURVE."""
    learner_public = learner_keys(keys_dir).public
    intruders = {
        "unlisted_key": CurveKeys(*zmq.curve_keypair(), learner_public),
        "wrong_learner_key": CurveKeys(*zmq.curve_keypair(), zmq.curve_keypair()[0]),
        "no_curve": None,
    }
    senders = []
    for name, keys in intruders.items():
        sender = GroupSender(address, f"intruder-{name}", curve=keys).start()
        group = _group("")
        sender.submit(group)
        senders.append(sender)
    sleep_checking(cluster, 8.0)
    result = {
        "attempted": len(senders),
        "acked": sum(s.acked_total for s in senders),
    }
    for sender in senders:
        sender.close(timeout_s=0.0)
    return result


# ------------------------------------------------------------------------------------- run


@dataclass
class Chaos:
    """One chaos run's pieces: its cluster, Redis, keys and what was injected."""

    cluster: Cluster
    redis_server: RedisServer
    address: str
    keys_dir: Path
    model_config: dict
    group_size: int
    faults: dict[str, int] = field(default_factory=dict)
    figures: dict = field(default_factory=dict)

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        log(f"fault: {kind}")


def start(work: Path, hosts: netns.Hosts | None) -> Chaos:
    """A private Redis, CurveZMQ keys for the actors and the flooder, and the cluster's config;
    with ``hosts``, this thread must be on the learner's host."""
    base = load_config([])
    model_dir = ensure_model(base)
    run_dir = work / "run"
    run_dir.mkdir()
    keys_dir = work / "keys"
    write_keys(keys_dir, ("actor", FLOOD_ID))
    host = "127.0.0.1" if hosts is None else netns.LEARNER_IP
    password = "chaos-" + os.urandom(4).hex()
    redis_server = RedisServer(password=password, bind=host)
    redis_server.start()
    address = f"tcp://{host}:{find_free_port(host)}"
    overrides = [
        f"run.name=chaos-{os.getpid()}",
        f"run.dir={run_dir}",
        "run.steps=100000",  # stopped by us, not by the budget
        "run.ledger=true",
        f"redis.url=redis://{host}:{redis_server.port}/0",  # the password: in the environment
        f"model.path={model_dir}",
        f"learner.address={address}",
        "learner.checkpoint_every=5",
        "learner.metrics_port=-1",
        "actor.metrics_port=-1",
        "actor.heartbeat_interval_s=0.5",
        "actor.resend_timeout_s=5",
        f"security.curve_dir={keys_dir}",
    ]
    model_config = json.loads((model_dir / "config.json").read_text())
    cluster = Cluster(run_dir, overrides, {"SPECRL_REDIS_PASSWORD": password}, hosts)
    return Chaos(cluster, redis_server, address, keys_dir, model_config, base.actor.group_size)


def inject_faults(chaos: Chaos, outage_s: float, steps_between: int) -> None:
    """The seven faults in turn, training on between them."""
    cluster, run_dir = chaos.cluster, chaos.cluster.run_dir
    vocab_size = chaos.model_config["vocab_size"]
    flood_keys = actor_keys(chaos.keys_dir, FLOOD_ID)
    wait_steps(cluster, 3, 300)

    # 1. An actor killed with unacked groups in its spool, restarted under the same name.
    chaos.fault("actor_sigkill")
    cluster.learner.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not any((run_dir / "spool").glob("*-0/*/*.frame")):
        if time.monotonic() > deadline:
            raise TimeoutError("actor 0 spooled nothing while the learner was frozen")
        time.sleep(0.1)
    time.sleep(1.0)
    cluster.actors[0].kill()
    cluster.actors[0].wait()
    cluster.learner.send_signal(signal.SIGCONT)
    cluster.actors[0].start()
    wait_steps(cluster, steps_between, 300)

    # 2. The learner killed outright and restarted.
    chaos.fault("learner_sigkill")
    # Off the step boundary (a kill right after a checkpoint would test little): mid-step,
    # with groups acked since the last checkpoint that only the write-ahead log holds.
    done = len(steps(run_dir))
    wait_steps(cluster, (done // 5 + 1) * 5 + 2 - done, 300)  # 2 steps past a checkpoint
    sleep_checking(cluster, random.Random(0).uniform(0.2, 1.0))
    cluster.learner.kill()
    cluster.learner.wait()
    sleep_checking(cluster, 3.0, learner_frozen=True)
    cluster.learner.start()
    wait_steps(cluster, steps_between, 300)

    # 3. Redis restarted empty.
    chaos.fault("redis_restart")
    chaos.redis_server.stop()
    sleep_checking(cluster, 3.0)
    chaos.redis_server.start()
    wait_steps(cluster, steps_between, 300)

    # 4. A flood of bad frames from an authenticated (buggy or hostile) peer.
    chaos.fault("bad_frame_flood")
    chaos.figures["bad_frames_by_kind"] = flood(chaos.address, flood_keys, vocab_size, repeat=20)
    wait_steps(cluster, 1, 300)

    # 5. Well-formed groups no learner may train on, from the same authenticated peer.
    chaos.fault("poisoned_frames")
    context = chaos.model_config["max_position_embeddings"]
    chaos.figures["poisoned"] = poison(
        chaos.address, flood_keys, chaos.group_size, context, run_dir
    )
    wait_steps(cluster, 1, 300)

    # 6. Senders without an authorized key.
    chaos.fault("unauthenticated_sender")
    chaos.figures["unauthenticated"] = unauthenticated(chaos.address, chaos.keys_dir, cluster)

    # 7. The learner unreachable (frozen) for a minute.
    chaos.fault("learner_unreachable")
    cluster.learner.send_signal(signal.SIGSTOP)
    sleep_checking(cluster, outage_s, learner_frozen=True)
    cluster.learner.send_signal(signal.SIGCONT)
    wait_steps(cluster, steps_between, 300)


def trained_from(run_dir: Path, index: int, after_step: int) -> int:
    """Groups of actor ``index`` (ids are ``{host}-{index}-{suffix}``) trained after a step."""
    trained = read_ledger(run_dir).trained
    return sum(r["actor_id"].rsplit("-", 2)[1] == str(index) and r["step"] > after_step
               for r in trained)  # fmt: skip


def partition(chaos: Chaos, hold_s: float, steps_between: int) -> None:
    """8. Actor 1's host cut off from the learner's (and Redis') for ``hold_s``, then healed:
    it must come back and be trained on again, and nothing it sent be lost or trained twice."""
    cluster, hosts, victim = chaos.cluster, chaos.cluster.hosts, 1
    assert hosts is not None
    redis_port = chaos.redis_server.port
    chaos.fault("network_partition")
    hosts.partition(victim)
    try:
        cut = not netns.reachable(hosts.actors[victim], netns.LEARNER_IP, redis_port)
        others = netns.reachable(hosts.actors[1 - victim], netns.LEARNER_IP, redis_port)
        sleep_checking(cluster, hold_s)
    finally:
        hosts.heal(victim)
    # Groups of the step being assembled at the heal may predate it: count from the next one.
    healed_at = max((r[mn.LEARNER_STEP] for r in steps(cluster.run_dir)), default=0) + 1
    deadline = time.monotonic() + 300
    while not trained_from(cluster.run_dir, victim, healed_at):
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor {victim} was not trained on within 300 s of the heal")
        sleep_checking(cluster, 0.5)
    wait_steps(cluster, steps_between, 300)
    chaos.figures["partition"] = {
        "held_s": hold_s,
        "partitioned_actor_unreachable": cut,
        "other_actor_reachable": others,
        "partitioned_actor_trained_after_heal": trained_from(cluster.run_dir, victim, healed_at),
    }


def outcome(chaos: Chaos, exit_codes: dict[str, int | None]) -> dict:
    """The run's figures, from the ledger, the learner's last metrics and what was injected."""
    run_dir, figures = chaos.cluster.run_dir, chaos.figures
    ledger = read_ledger(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    exits = [r for r in records if r.get("event") == "learner_exit"]
    final = exits[-1] if exits else {}
    versions = [r[mn.LEARNER_VERSION] for r in records if mn.LEARNER_STEP in r and "event" not in r]
    poisoned = figures.get("poisoned", {})
    unauthenticated = figures.get("unauthenticated", {})
    return {
        "faults_injected": chaos.faults,
        "fault_kinds": len(chaos.faults),
        "hosts": "network namespaces" if chaos.cluster.hosts else figures["netns_unavailable"],
        "partition": figures.get("partition", {}),
        "groups_produced": len(ledger.produced),
        "groups_consumed": len(ledger.consumed),
        "groups_trained": sum(o == "trained" for o in ledger.outcomes.values()),
        "groups_dropped_stale": sum(o == "stale" for o in ledger.outcomes.values()),
        "groups_lost": len(ledger.lost()),
        "groups_duplicated": len(ledger.duplicated()),
        "groups_unknown": len(ledger.unknown()),
        "groups_unacked_at_exit_spooled": len(ledger.unacked_at_exit - set(ledger.consumed)),
        "groups_pending_in_checkpoint": len(ledger.pending_at_exit),
        "outcomes_voided_by_learner_restart": ledger.voided,
        "bad_frames_sent": sum(figures.get("bad_frames_by_kind", {}).values())
        + poisoned.get("bad_sent", 0),
        "bad_frames_rejected": int(final.get(mn.RECEIVER_BAD_FRAMES, -1)),
        "bad_frames_by_reason": {
            k.removeprefix(mn.RECEIVER_BAD_FRAMES_PREFIX): int(v)
            for k, v in final.items()
            if k.startswith(mn.RECEIVER_BAD_FRAMES_PREFIX) and v
        },
        "poisoned_sent": poisoned.get("sent", 0),
        "poisoned_refused_sent": poisoned.get("refused_sent", 0),
        "poisoned_refused_acked": poisoned.get("refused_acked", 0),
        "groups_refused_by_learner": int(final.get(mn.RECEIVER_REFUSED, -1)),
        "groups_refused_in_ledger": sum(ledger.refused.values()),
        "policy_finite": policy_finite(run_dir),
        "unauthenticated_attempted": unauthenticated.get("attempted", 0),
        "unauthenticated_acked": unauthenticated.get("acked", 0),
        "unauthenticated_refused": int(final.get(mn.RECEIVER_UNAUTHENTICATED, 0)),
        "learner_crashes_unplanned": chaos.cluster.learner_crashes_unplanned,
        "actor_crashes_unplanned": chaos.cluster.actor_crashes_unplanned,
        "learner_starts": ledger.learner_starts,
        "versions_monotonic": versions == sorted(versions) and len(set(versions)) == len(versions),
        "final_version": versions[-1] if versions else None,
        "steps": len(versions),
        "exit_codes": exit_codes,
    }


def checks(result: dict) -> dict[str, bool]:
    """What a passing run must show."""
    refused = (
        result["poisoned_refused_acked"]
        == result["poisoned_refused_sent"]
        == result["groups_refused_by_learner"]
        == result["groups_refused_in_ledger"]
        > 0
    )
    cut = result["partition"]
    netns_ok = result["hosts"] == "network namespaces"
    partition = all(cut.get(k) for k in ("partitioned_actor_unreachable", "other_actor_reachable"))
    return {
        "8 fault kinds (7 where namespaces cannot be made)": result["fault_kinds"]
        >= (8 if netns_ok else 7),
        "partition held, healed, the actor trained on again": not netns_ok
        or (partition and cut.get("partitioned_actor_trained_after_heal", 0) > 0),
        "groups_lost == 0": result["groups_lost"] == 0,
        "groups_duplicated == 0": result["groups_duplicated"] == 0,
        "groups_unknown == 0": result["groups_unknown"] == 0,
        "bad_frames_rejected == bad_frames_sent": result["bad_frames_rejected"]
        == result["bad_frames_sent"],
        "poisoned groups refused (acked as refused, counted, in the ledger)": refused,
        "policy finite": result["policy_finite"],
        "unauthenticated refused, none acked": result["unauthenticated_refused"]
        >= result["unauthenticated_attempted"]
        and result["unauthenticated_acked"] == 0,
        "learner_crashes_unplanned == 0": result["learner_crashes_unplanned"] == 0,
        "actor_crashes_unplanned == 0": result["actor_crashes_unplanned"] == 0,
        "versions never go backwards": result["versions_monotonic"],
        "clean exits": all(code == 0 for code in result["exit_codes"].values()),
    }


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter outage and run (< 3 min)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specrl-chaos-"))
    reason = netns.unavailable()
    with contextlib.ExitStack() as stack:
        hosts = None
        if reason is None:
            hosts = stack.enter_context(netns.Hosts.create(actors=2))
            stack.enter_context(netns.entered(hosts.learner))  # Redis, flooders: the learner's host
        else:
            log(f"SPECRL-CHAOS: network_partition SKIPPED: {reason} (all on loopback)")
        chaos = start(work, hosts)
        chaos.figures["netns_unavailable"] = reason
        try:
            chaos.cluster.learner.start()
            for proc in chaos.cluster.actors.values():
                proc.start()
            log(f"pipeline up (run dir {chaos.cluster.run_dir}); warming up")
            inject_faults(chaos, 15.0 if args.quick else 60.0, 2 if args.quick else 6)
            if hosts is not None:
                partition(chaos, 8.0 if args.quick else 20.0, 2 if args.quick else 6)
            log("faults done; stopping cleanly")
        finally:
            exit_codes = chaos.cluster.stop()
            chaos.redis_server.close()
    result = {"quick": args.quick, **outcome(chaos, exit_codes)}
    result |= {
        "wall_s": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
    }
    result["checks"] = checks(result)
    result["passed"] = all(result["checks"].values())
    width = max(map(len, result)) + 2
    for key, value in result.items():
        if key not in ("checks", "machine", "exit_codes", "bad_frames_by_reason", "partition"):
            print(f"  {key:<{width}} {value}")
    for name, ok in result["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    cli.write_json(result, args.json)
    if args.keep or not result["passed"]:
        print(f"run directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
