"""The actor leaves a rollout in flight at the next decoding step once a stop is requested."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.loop import ActorPhases, GenerationStopped


def test_weight_source_raises_once_a_stop_is_requested() -> None:
    flag = {"stop": False}
    fetched = []
    phases = SimpleNamespace(stop=lambda: flag["stop"], fetch=lambda: fetched.append(1))
    assert ActorPhases.weight_source(phases) is None  # type: ignore[arg-type]
    assert fetched == [1]
    flag["stop"] = True
    with pytest.raises(GenerationStopped):
        ActorPhases.weight_source(phases)  # type: ignore[arg-type]
    assert fetched == [1]  # no fetch once stopping
