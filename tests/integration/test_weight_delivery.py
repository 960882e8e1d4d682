"""benchmarks/weight_delivery.py (the delivery run of benchmarks/weights.py) on its small model: a learner publishing back to back
through the latest-wins publisher (upload process) while two actor processes decode with their
background weight feeds and a shared host cache, all on a real Redis. The stall meter counts the
engine's loads (and the in-flight verification at a swap); taking from the feed blocks the loop
for under 5% of the delivery windows."""

from __future__ import annotations

import pytest
import redis

from benchmarks import weight_delivery
from common import metric_names as mn
from ops.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_actors_decode_through_deliveries_and_skipped_versions_are_counted(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    figures = weight_delivery.delivery_figures(redis_server.url, redis_client, quick=True)
    published = figures["delivery_versions_published"]
    uploaded = figures["delivery_versions_uploaded"]
    # Uploads are slower than steps published back to back: some versions never went out, and
    # the publisher counted exactly those.
    assert uploaded < published
    assert figures["delivery_versions_skipped"] == published - uploaded
    assert figures["skipped_versions_counted"] is True
    # Both actors end on the last uploaded version, having decoded while versions arrived.
    assert figures["delivery_actor_versions"] == [figures["delivery_final_version"]] * 2
    for actor in figures["delivery_actors"]:
        assert actor["versions_taken"] >= 1 and actor["tokens"] > 0
        assert actor["polls_during_delivery"] > 0
        loop_s, stall_s = actor[mn.ACTOR_DECODE_S_DURING_DELIVERY], actor[mn.ACTOR_DECODE_STALL_S]
        load_s = actor[mn.ACTOR_WEIGHT_LOAD_S]
        assert loop_s > 0 and actor[mn.ACTOR_DECODE_STALL_FRAC] == stall_s / loop_s
        # The engine took in every version it was handed, and each load is in the stall.
        assert 0 < load_s <= stall_s, actor
        # Taking a version from the background feed almost never blocks the loop: what is not
        # loading is under 5% of the delivery windows (each poll only takes a lock).
        assert (stall_s - load_s) / loop_s < 0.05, actor
    take_only = figures["decode_stall_frac_take_only"]
    assert 0 <= take_only < 0.05
    assert figures["decode_stall_frac_during_delivery"] >= take_only
    assert figures["delivery_weight_load_s_mean"] > 0
