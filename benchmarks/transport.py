"""Trajectory transport: groups/s, MB/s and ack latency through the real ZeroMQ path with acks.

    python -m benchmarks.transport [--quick] [--json PATH] [--repeats R]
                                   [--tuned-outbox N] [--tuned-hwm N]

`common.link.send.sender.GroupSender` -> `common.link.receive.receiver.GroupReceiver` over tcp://127.0.0.1 (real
sockets), each in its own process (spawn, so neither waits on the other's GIL), as an actor and
the learner are. In the receiver process a consumer (its main thread) takes every group with
`receiver.intake.get()`, next to the receiver's own I/O thread; the sender process submits from its main
thread next to the sender's I/O thread. Groups are real `common.link.protocol.TrajectoryGroup`s of
`Completion`s (int32 token ids, float32 behaviour log-probs, int32 token versions):

  small   G=8 completions x 64 tokens, 32-token prompt (~7 KB on the wire)
  long    G=8 completions x 8192 tokens, 256-token prompt (~0.8 MB on the wire)

Per size, three sender settings: GroupSender's own default outbox_max (64 groups in flight:
the transport's headline figure, `groups_per_s_small`), the RL run's `actor.outbox_max` (4: a
staleness bound, kept small on purpose, which caps the window; suffix `_run_outbox`), and a
tuned one (`--tuned-outbox`, 256; `--tuned-hwm N` also sets the
receiver's ZeroMQ hwm for that row). Each setting runs `--repeats` times (fresh processes;
medians shown). Per run, after a warm-up:

  groups/s, MB/s     N groups submitted back to back; time from the first submit until every
                     group is both acked to the sender and taken by the consumer (MB = 10^6
                     bytes of encoded frames)
  ack RTT ms         one group at a time (submit, then flush until its ack): p50 and p99, the
                     latency of an idle link
  loaded ack ms      mean time a group waits for its ack during the N-group run, by Little's law
                     (mean unacked groups at each submit / groups per s); with a full outbox this
                     is outbox_max / throughput
  resent             groups the sender sent again (summed over repeats): acks that never came
  CPU us/group       CPU time of the sender / receiver process (all threads, zmq's included)
                     per group during the N-group run: the cost that bounds groups/s on few cores

Other benchmarks share the cores: run the measured figures under a lock, e.g.
    flock /tmp/specrl-bench.lock python -m benchmarks.transport --json transport.json
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import cli
from benchmarks._procs import Children
from common import metric_names as mn
from common.config.actor import ActorConfig
from common.link.protocol import Completion, DecodeLimits, TrajectoryGroup, encode
from common.link.receive.receiver import GroupReceiver
from common.link.send.sender import GroupSender, unique_actor_id
from common.link.transport import DEFAULT_HWM

ROOT = Path(__file__).resolve().parent.parent

MB = 10**6
VOCAB = 32000
# label -> (completions per group, tokens per completion, prompt tokens)
SIZES = {"small": (8, 64, 32), "long": (8, 8192, 256)}
SENDER_DEFAULT_OUTBOX = 64  # GroupSender's own default outbox_max
TARGET_GROUPS_PER_S_SMALL = 5000.0
TIMEOUT_S = 300.0


def make_group(label: str, seed: int = 0) -> TrajectoryGroup:
    group_size, tokens, prompt_tokens = SIZES[label]
    rng = np.random.default_rng(seed)
    completions = [
        Completion(
            token_ids=rng.integers(0, VOCAB, tokens, dtype=np.int32),
            behaviour_logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
            token_versions=np.full(tokens, 3, dtype=np.int32),
            reward=float(rng.random()),
            finished=bool(i % 2),
        )
        for i in range(group_size)
    ]
    return TrajectoryGroup(
        actor_id="",
        seq=0,
        prompt_id=f"prompt-{seed}",
        prompt_ids=rng.integers(0, VOCAB, prompt_tokens, dtype=np.int32),
        version=3,
        completions=completions,
        stats={mn.ACTOR_GENERATE_S: 0.5, mn.ACTOR_TOKENS: float(group_size * tokens)},
    )


# ------------------------------------------------------------------------------ processes


def cpu_s() -> float:
    """CPU seconds of this process, all threads (zmq's included)."""
    times = os.times()
    return times.user + times.system


def receiver_main(
    total: int,
    timed_from: int,
    queue_max: int,
    hwm: int | None,
    results: mp.Queue,
    stop: mp.Event,
) -> None:
    """The learner's end: a GroupReceiver plus a consumer (this thread) taking ``total`` groups.

    The receiver stays up until ``stop``: the sender may still need an ack (or a resend) after
    the consumer has every group, as with a learner that keeps running."""
    extra = {} if hwm is None else {"hwm": hwm}
    receiver = GroupReceiver(
        "tcp://127.0.0.1:*", DecodeLimits(vocab_size=VOCAB), queue_max=queue_max, **extra
    ).start()
    results.put(("address", receiver.bound_address))
    got = 0
    cpu_start = 0.0
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while got < total and time.monotonic() < deadline:
            if receiver.intake.get(timeout_s=0.5) is not None:
                got += 1
                if got == timed_from:
                    cpu_start = cpu_s()
        results.put(("consumed", got, time.monotonic(), cpu_s() - cpu_start))
        stop.wait(TIMEOUT_S)
        results.put(("receiver", receiver.intake.duplicates, receiver.intake.acks_sent))
    finally:
        receiver.close()


def sender_main(
    address: str, label: str, count: int, warmup: int, rtt_probes: int, outbox_max: int,
    results: mp.Queue,
) -> None:  # fmt: skip
    """The actor's end: warm up, probe the idle ack RTT, then submit ``count`` groups."""
    group = make_group(label)
    frame_bytes = len(encode(group))
    sender = GroupSender(address, unique_actor_id("bench"), outbox_max=outbox_max).start()
    try:
        for _ in range(warmup):
            sender.submit(group)
        if not sender.flush(TIMEOUT_S):
            raise TimeoutError("warm-up groups not acked")
        rtts = []
        for _ in range(rtt_probes):
            start = time.perf_counter()
            sender.submit(group)
            if not sender.flush(TIMEOUT_S):
                raise TimeoutError("probe group not acked")
            rtts.append(time.perf_counter() - start)
        unacked = 0
        cpu_start = cpu_s()
        start = time.monotonic()
        for _ in range(count):
            unacked += sender.unacked()
            sender.submit(group)
        if not sender.flush(TIMEOUT_S):
            raise TimeoutError(f"{sender.unacked()} groups not acked")
        acked = time.monotonic()
        cpu = cpu_s() - cpu_start
        results.put(
            ("sent", start, acked, unacked / count, rtts, frame_bytes, sender.resent_total, cpu)
        )
    finally:
        sender.close(timeout_s=1.0)


def run_config(
    label: str, count: int, outbox_max: int, rtt_probes: int, receiver_hwm: int | None = None
) -> dict[str, float]:
    warmup = min(count, 2 * outbox_max, 500)
    total = warmup + rtt_probes + count
    with Children(TIMEOUT_S) as children:
        results, stop = children.results, children.stop
        receiver_args = (total, warmup + rtt_probes, 1024, receiver_hwm, results, stop)
        children.start(receiver_main, *receiver_args, name="receiver")
        address = children.get("address")[1]
        sender_args = (address, label, count, warmup, rtt_probes, outbox_max, results)
        children.start(sender_main, *sender_args, name="sender")
        # The consumer may finish before or after the sender has its last ack.
        messages = {m[0]: m for m in (children.get("sent", "consumed") for _ in "ab")}
        stop.set()
        messages["receiver"] = children.get("receiver")
    _, start, acked, mean_unacked, rtts, frame_bytes, resent, sender_cpu = messages["sent"]
    _, consumed, consumed_at, receiver_cpu = messages["consumed"]
    _, duplicates, acks_sent = messages["receiver"]
    if consumed != total:
        raise RuntimeError(f"consumer got {consumed} of {total} groups")
    elapsed = max(acked, consumed_at) - start
    groups_per_s = count / elapsed
    rtts_ms = sorted(r * 1e3 for r in rtts)
    return {
        "groups_per_s": groups_per_s,
        "mb_per_s": groups_per_s * frame_bytes / MB,
        "ack_rtt_ms_p50": statistics.median(rtts_ms),
        "ack_rtt_ms_p99": rtts_ms[min(len(rtts_ms) - 1, int(0.99 * len(rtts_ms)))],
        "loaded_ack_ms": mean_unacked / groups_per_s * 1e3,
        "frame_kb": frame_bytes / 1e3,
        "sender_cpu_us_per_group": sender_cpu / count * 1e6,
        "receiver_cpu_us_per_group": receiver_cpu / count * 1e6,
        "resent": float(resent),
        "duplicates": float(duplicates),
        "acks_sent": float(acks_sent),
    }


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer groups, 1 repeat (< 60 s)")
    parser.add_argument("--repeats", type=int, default=0, help="runs per setting (default 3)")
    parser.add_argument(
        "--tuned-outbox", type=int, default=256, help="GroupSender outbox_max of the tuned row"
    )
    parser.add_argument(
        "--tuned-hwm", type=int, default=None, help="GroupReceiver hwm of the tuned row"
    )
    opts = parser.parse_args()
    started = time.perf_counter()
    counts = {"small": 3000, "long": 200} if opts.quick else {"small": 20000, "long": 1000}
    rtt_probes = 50 if opts.quick else 200
    repeats = opts.repeats or (1 if opts.quick else 3)
    # key suffix -> (outbox_max, receiver hwm; None: GroupReceiver's default)
    settings = {
        "": (SENDER_DEFAULT_OUTBOX, None),
        "_run_outbox": (ActorConfig().outbox_max, None),
        "_tuned": (opts.tuned_outbox, opts.tuned_hwm),
    }

    flat: dict[str, float] = {}
    table = []
    for label, count in counts.items():
        for suffix, (outbox_max, hwm) in settings.items():
            runs = [run_config(label, count, outbox_max, rtt_probes, hwm) for _ in range(repeats)]
            figures = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            figures["resent"] = sum(run["resent"] for run in runs)  # over all repeats
            figures["duplicates"] = sum(run["duplicates"] for run in runs)
            table.append((label, outbox_max, hwm, count, figures))
            for key, value in figures.items():
                flat[f"{key}_{label}{suffix}"] = round(value, 3)
            print(
                f"{label} outbox_max={outbox_max} hwm={hwm or DEFAULT_HWM}: "
                f"groups/s {[round(run['groups_per_s']) for run in runs]}, "
                + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()),
                flush=True,
            )

    print()
    header = ["groups", "outbox_max", "receiver hwm", "N", "frame KB", "groups/s", "MB/s"]
    header += ["ack RTT ms p50 / p99", "loaded ack ms", "resent"]
    header += ["CPU us/group sender / receiver"]
    rows = [
        [label, outbox_max, hwm or DEFAULT_HWM, count, f"{f['frame_kb']:.1f}"]
        + [f"{f['groups_per_s']:,.0f}", f"{f['mb_per_s']:,.1f}"]
        + [f"{f['ack_rtt_ms_p50']:.2f} / {f['ack_rtt_ms_p99']:.2f}"]
        + [f"{f['loaded_ack_ms']:.1f}", f"{f['resent']:.0f}"]
        + [f"{f['sender_cpu_us_per_group']:,.0f} / {f['receiver_cpu_us_per_group']:,.0f}"]
        for label, outbox_max, hwm, count, f in table
    ]
    print(cli.table(header, rows))

    small = flat["groups_per_s_small"]
    summary = {
        **cli.target("groups_per_s_small", small, TARGET_GROUPS_PER_S_SMALL),
        "outbox_max": ActorConfig().outbox_max,
        "tuned_outbox_max": opts.tuned_outbox,
        "tuned_receiver_hwm": opts.tuned_hwm,
        "repeats": repeats,
        "quick": opts.quick,
        "seconds": round(time.perf_counter() - started, 1),
        **flat,
    }
    print(
        f"\ngroups_per_s_small = {small:,.0f} (target >= {TARGET_GROUPS_PER_S_SMALL:,.0f}; "
        f"the run's outbox_max {ActorConfig().outbox_max}: "
        f"{flat['groups_per_s_small_run_outbox']:,.0f}, tuned: "
        f"{flat['groups_per_s_small_tuned']:,.0f}), median of {repeats}, {summary['seconds']} s"
    )
    return cli.finish(summary, opts.json)


if __name__ == "__main__":
    sys.exit(main())
