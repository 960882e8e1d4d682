"""Prometheus exporters: real servers on free ports, scraped over HTTP and parsed."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch

from actors.exporter import ActorExporter
from common.config import load_config
from learner.exporter import LearnerExporter
from testing.prometheus import scrape


def port_file(run_dir: Path, role: str) -> int:
    return int((run_dir / "prometheus" / f"{role}.port").read_text())


def learner_step(step: int, **extra: float) -> dict[str, float]:
    return {
        "learner/step": step,
        "learner/version": step + 1,
        "learner/groups": 4,
        "learner/reward_mean": 0.25 * step,
        "learner/dropped_stale": 3,
        "learner/rejected_groups": 1,
        "receiver/received": 10 * step,
        "receiver/duplicates": 2,
        "receiver/bad_frames": 5,
        "receiver/bad_frames/bad_field": 4,
        "receiver/bad_frames/oversize": 1,
        "receiver/queue_size": 7,
        "actor/live": 2,
        "actor/tokens_per_s": 1234.5,
        "spec/acceptance_rate": 0.6,
        "verify/salvaged_frac": 0.9,
        "verify/acceptance_gap1": 0.8,
        "learner/wait_s": 1.0,
        "learner/train_s": 2.0,
        "learner/publish_s": 1.0,
        "learner/wall_s": 4.0 * step,
        **extra,
    }


def test_learner_exporter_serves_the_step_figures(tmp_path):
    cfg = load_config(["learner.metrics_port=0"])
    with LearnerExporter.start(cfg, tmp_path) as exporter:
        assert exporter.enabled and port_file(tmp_path, "learner") == exporter.port
        exporter.update(learner_step(1), torch.tensor([0, 1, 1, 2]))
        exporter.update(learner_step(2, **{"receiver/unauthenticated": 3}), [0, 0, 9, 2])
        m = scrape(exporter.port)
    assert m[("specrl_learner_version", ())] == 3
    assert m[("specrl_learner_step", ())] == 2
    assert m[("specrl_learner_reward_mean", ())] == 0.5
    # Counters are the learner's cumulative totals, not sums of them.
    assert m[("specrl_learner_groups_received_total", ())] == 20
    assert m[("specrl_learner_groups_dropped_stale_total", ())] == 3
    assert m[("specrl_learner_groups_duplicated_total", ())] == 2
    assert m[("specrl_learner_groups_rejected_total", ())] == 1
    assert m[("specrl_learner_unauthenticated_refused_total", ())] == 3
    assert m[("specrl_learner_bad_frames_total", (("reason", "bad_field"),))] == 4
    assert m[("specrl_learner_bad_frames_total", (("reason", "oversize"),))] == 1
    # Groups trained are summed over steps by the exporter.
    assert m[("specrl_learner_groups_trained_total", ())] == 8
    assert m[("specrl_learner_actor_tokens_per_s", ())] == 1234.5
    assert m[("specrl_learner_live_actors", ())] == 2
    assert m[("specrl_learner_queue_depth", ())] == 7
    assert m[("specrl_learner_spec_acceptance_rate", ())] == pytest.approx(0.6)
    assert m[("specrl_learner_verify_salvaged_frac", ())] == pytest.approx(0.9)
    assert m[("specrl_learner_verify_acceptance_gap1", ())] == pytest.approx(0.8)
    assert m[("specrl_learner_busy_fraction", ())] == pytest.approx(6.0 / 8.0)
    assert m[("specrl_learner_busy_seconds_total", ())] == pytest.approx(6.0)
    assert m[("specrl_learner_wait_seconds_total", ())] == pytest.approx(2.0)
    # Staleness: one observation per group, integer buckets 0..8 then +Inf.
    assert m[("specrl_learner_staleness_count", ())] == 8
    assert m[("specrl_learner_staleness_bucket", (("le", "0.0"),))] == 3
    assert m[("specrl_learner_staleness_bucket", (("le", "1.0"),))] == 5
    assert m[("specrl_learner_staleness_bucket", (("le", "8.0"),))] == 7
    assert m[("specrl_learner_staleness_bucket", (("le", "+Inf"),))] == 8
    assert m[("specrl_learner_weight_publish_seconds_count", ())] == 2
    assert m[("specrl_learner_weight_publish_seconds_sum", ())] == pytest.approx(2.0)
    # Closed: the port file goes with the server.
    assert not (tmp_path / "prometheus" / "learner.port").exists()


def test_actor_exporter_labels_every_sample_with_the_actor(tmp_path):
    cfg = load_config(["actor.metrics_port=0", "actor.index=3"])
    with ActorExporter.start(cfg, tmp_path, "host-3") as exporter:
        assert port_file(tmp_path, "actor-3") == exporter.port
        status = {
            "actor/tokens": 100.0,
            "actor/gen_time_s": 0.5,
            "actor/tokens_per_s": 200.0,
            "spec/acceptance_rate": 0.7,
            "spec/mean_accepted_len": 3.5,
            "verify/swaps": 1.0,
            "verify/salvaged_frac": 0.95,
            "sender/unacked": 2.0,
            "sender/acked_total": 11.0,
            "sender/resent_total": 1.0,
            "actor/weight_fetch_s": 0.02,
            "actor/wait_s": 0.0,
            "actor/reward_mean": 0.4,
        }
        exporter.update({**status, "actor/batches": 1, "actor/groups_sent": 2}, version=5)
        exporter.update({**status, "actor/batches": 2, "actor/groups_sent": 4}, version=6)
        exporter.observe_weight_fetch(0.02)
        exporter.observe_weight_fetch(0.3)
        m = scrape(exporter.port)
    me = (("actor_id", "host-3"),)
    assert m[("specrl_actor_version", me)] == 6
    assert m[("specrl_actor_batches_total", me)] == 2
    assert m[("specrl_actor_groups_sent_total", me)] == 4
    assert m[("specrl_actor_groups_acked_total", me)] == 11
    assert m[("specrl_actor_groups_resent_total", me)] == 1
    assert m[("specrl_actor_tokens_total", me)] == 200  # per-batch amounts are summed
    assert m[("specrl_actor_verify_swaps_total", me)] == 2
    assert m[("specrl_actor_tokens_per_s", me)] == 200
    assert m[("specrl_actor_spec_acceptance_rate", me)] == pytest.approx(0.7)
    assert m[("specrl_actor_spec_mean_accepted_len", me)] == pytest.approx(3.5)
    assert m[("specrl_actor_verify_salvaged_frac", me)] == pytest.approx(0.95)
    assert m[("specrl_actor_outbox_depth", me)] == 2
    assert m[("specrl_actor_reward_mean", me)] == pytest.approx(0.4)
    assert m[("specrl_actor_wait_seconds_total", me)] == 0
    assert m[("specrl_actor_weight_fetch_seconds_count", me)] == 2
    assert m[("specrl_actor_weight_fetch_seconds_bucket", (*me, ("le", "0.025")))] == 1


def test_actor_port_is_base_plus_index(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    cfg = load_config([f"actor.metrics_port={base - 2}", "actor.index=2"])
    with ActorExporter.start(cfg, tmp_path, "a") as exporter:
        assert exporter.port == base
        assert port_file(tmp_path, "actor-2") == base


def test_minus_one_is_off_and_updates_do_nothing(tmp_path):
    cfg = load_config(["learner.metrics_port=-1", "actor.metrics_port=-1"])
    learner = LearnerExporter.start(cfg, tmp_path)
    actor = ActorExporter.start(cfg, tmp_path, "a")
    for exporter in (learner, actor):
        assert not exporter.enabled and exporter.port is None
    learner.update(learner_step(1), [0, 1])
    actor.update({"actor/tokens": 1.0}, version=1)
    actor.observe_weight_fetch(0.1)
    learner.close()
    actor.close()
    assert not (tmp_path / "prometheus").exists()


def test_taken_port_warns_and_runs_on(tmp_path, caplog):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        cfg = load_config([f"learner.metrics_port={taken}"])
        with caplog.at_level(logging.WARNING, logger="common.prometheus"):
            exporter = LearnerExporter.start(cfg, tmp_path)
        assert not exporter.enabled
        exporter.update(learner_step(1), [0])
        exporter.close()
    assert "running without metrics" in caplog.text and str(taken) in caplog.text
    assert not (tmp_path / "prometheus" / "learner.port").exists()


def test_the_drafts_training_figures_are_learner_gauges(tmp_path):
    cfg = load_config(["learner.metrics_port=0"])
    figures = {
        "spec/draft_acceptance": 0.5,
        "spec/draft_acceptance_step1": 0.6,
        "spec/draft_acceptance_step4": 0.3,
        "spec/draft_chain_estimate": 2.1,
        "spec/eagle_kl": 0.7,
        "spec/eagle_lr": 1e-4,
    }
    with LearnerExporter.start(cfg, tmp_path) as exporter:
        exporter.update(learner_step(1, **figures), [0])
        m = scrape(exporter.port)
    for key, value in figures.items():
        name = "specrl_learner_" + key.replace("/", "_")
        assert m[(name, ())] == pytest.approx(value), name
