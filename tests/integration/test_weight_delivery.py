"""benchmarks/weights.py's delivery run on its small model: a learner publishing back to back
through the latest-wins publisher (upload process) while two actor processes decode with their
background weight feeds and a shared host cache, all on a real Redis."""

from __future__ import annotations

import math

import pytest
import redis

from benchmarks import weights
from common import metric_names as mn
from ops.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_actors_decode_through_deliveries_and_skipped_versions_are_counted(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    figures = weights.delivery_figures(redis_server.url, redis_client, quick=True)
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
        assert actor[mn.ACTOR_DECODE_S_DURING_DELIVERY] > 0
        assert 0.0 <= actor[mn.ACTOR_DECODE_STALL_FRAC] < 1.0
    assert not math.isnan(figures["decode_stall_frac_during_delivery"])
