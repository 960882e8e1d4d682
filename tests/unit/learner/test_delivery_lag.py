"""The weight-delivery lag the staleness bound follows (``learner.max_staleness_from_lag``)."""

from __future__ import annotations

import pytest

from common.config import load_config
from learner.buffer import LAG_WINDOW, DeliveryLag


def test_the_lag_is_the_slowest_live_actor_the_most_over_the_window():
    lag = DeliveryLag(floor=2, cap=8)
    assert lag.bound() == 2 and lag.lag == 0  # no reading yet: the floor
    assert lag.observe(10, [10, 7, 9]) == 4  # the slowest holds 7: lag 3, bound 4
    assert lag.observe(11, [11, 11]) == 4  # caught up; the window keeps the 3
    assert lag.observe(12, [-1]) == 4  # an actor that has not reported a version is left out
    for v in range(13, 13 + LAG_WINDOW):
        lag.observe(v, [v])
    assert lag.lag == 0 and lag.bound() == 2  # the 3 left the window: back to the floor
    assert lag.observe(40, [20]) == 8  # lag 20, capped


def test_without_a_cap_the_bound_is_max_staleness():
    lag = DeliveryLag(floor=2)
    assert lag.observe(30, [0]) == 2
    assert lag.lag == 30  # still measured and reported


def test_the_cap_needs_a_floor_it_can_rise_from():
    assert load_config(["learner.max_staleness_from_lag=8"]).learner.max_staleness_from_lag == 8
    with pytest.raises(ValueError, match="on-policy runs wait for each version"):
        load_config(["learner.max_staleness=0", "learner.max_staleness_from_lag=8"])
