"""No request started after a weight swap reads KV computed under the old weights, in any
in-flight mode, with requests running during the swap (vLLM refuses to reset the prefix cache
then; the version in every request's ``cache_salt`` keeps later requests off the old blocks)."""

from __future__ import annotations

import pytest

from actors.engines.torch.engine import TorchEngine
from actors.engines.vllm.engine import VllmEngine
from common.model import save_pretrained
from testing.vllm import greedy_vllm, weights

pytestmark = pytest.mark.vllm

# Longer than one KV block (32 here), so the prefix cache holds a full block of it.
LONG = [1] + [3 + (i * 7) % 50 for i in range(44)]
OTHER = [1] + [4 + (i * 5) % 50 for i in range(40)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-kv")
    save_pretrained(weights(0), path)
    return greedy_vllm(
        path,
        eos_id=99,  # outside the vocabulary: rows run to the budget and are running at the swap
        vllm_max_model_len=128,
        vllm_kwargs={"block_size": 32},
    )


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return (
        TorchEngine(model, 99, 0, temperature=0.0).generate([prompt], 1, n)[0][0].token_ids.tolist()
    )


def fresh_after_swap(engine: VllmEngine, mode: str, version: int) -> list[int]:
    engine.inflight = mode
    engine.load_weights(version - 1, weights(0).state_dict())
    engine.generate([LONG], 1, 8)  # fills the prefix cache with LONG under the old weights
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (version, weights(1).state_dict()) if calls["n"] == 2 else None

    out = engine.generate([OTHER, LONG], 1, 12, weight_source=source)
    versions = [set(g[0].token_versions.tolist()) for g in out]
    assert any(version in v for v in versions), versions  # the swap happened mid-rollout
    if mode == "keep":
        assert {version - 1, version} in versions  # stale prefix, new suffix, both recorded
    else:
        assert all(v == {version} for v in versions)  # verified or regenerated under v1
    fresh = engine.generate([LONG], 1, 8)[0][0]
    assert set(fresh.token_versions.tolist()) == {version}
    return fresh.token_ids.tolist()


@pytest.mark.parametrize("mode", ["keep", "abort", "verify_on_swap"])
def test_fresh_request_after_swap_equals_new_weights(engine, mode):
    version = {"keep": 11, "abort": 21, "verify_on_swap": 31}[mode]
    assert fresh_after_swap(engine, mode, version) == greedy(weights(1), LONG, 8)


def test_negative_control_without_the_salt_reads_stale_kv(engine):
    engine.salt_kv_by_version = False
    try:
        stale = fresh_after_swap(engine, "keep", 41)
    finally:
        engine.salt_kv_by_version = True
    assert stale != greedy(weights(1), LONG, 8)
