"""The EAGLE-3 head's benchmark rows (benchmarks/eagle_rows.py for ``rollout.py --only real``,
benchmarks/engines_eagle.py for ``engines.py --only real``) without the real model: parameters
read per token counted exactly from a tiny model's shapes, the summary keys computed from the
rows' figures as the real section produces them, the preset directory getting the head the same
way it gets the adapter, and the chi-square checks passing while their controls fail."""

from __future__ import annotations

import gc
import math
import subprocess

import pytest
import torch

from benchmarks import eagle_rows, engines_eagle, real_preset, rollout_real
from common import metric_names as mn
from common.eagle import EAGLE_FILE, attach_eagle
from common.model import DRAFT_FILE, attach_draft
from testing.models import random_model
from testing.shapes import shape

H, FF, L, HEADS, KV, V = 32, 48, 4, 4, 2, 40
D = H // HEADS
EAGLE_IDS, ADAPTER_IDS = list(range(0, 24, 2)), list(range(10))


def tiny(tied: bool):
    model = random_model(**shape(V, H, FF, L, HEADS, KV, tie_word_embeddings=tied))
    attach_draft(model, 1, torch.tensor(ADAPTER_IDS))
    attach_eagle(model, aux_layers=(1, 2, 3), vocab_ids=torch.tensor(EAGLE_IDS))
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_param_reads_counts_every_tensor_from_shapes(tied):
    reads = eagle_rows.param_reads(tiny(tied))
    layer = H * HEADS * D + 2 * H * KV * D + HEADS * D * H + 3 * H * FF + 2 * H
    # The head's layer: q/k/v read [embedding ‖ hidden] (2H), three norms.
    head_layer = 2 * H * HEADS * D + 2 * (2 * H * KV * D) + HEADS * D * H + 3 * H * FF + 3 * H
    assert reads["decoder_layers"] == L * layer
    assert reads["lm_head"] == V * H  # read in full, tied or not
    assert reads["target_forward"] == L * layer + H + V * H + H
    assert reads["head_layer"] == head_layer
    assert reads["head_fc"] == 3 * H * H  # three auxiliary layers
    assert reads["eagle_draft_token"] == head_layer + H + len(EAGLE_IDS) * H + 3 * H * H + H
    assert reads["adapter_draft_token"] == layer + (layer + H) + len(ADAPTER_IDS) * H + H
    assert reads["unaccounted"] == 0


def test_param_reads_refuses_a_model_without_a_head():
    with pytest.raises(ValueError, match="no EAGLE-3 head"):
        eagle_rows.param_reads(random_model(V))


def epochs(speed: float, per_verify: float | None = None) -> list[dict[str, float]]:
    """Three epochs of a row as ``TorchEngine.stats`` reports them (median = the middle one)."""
    out = []
    for scale in (0.9, 1.0, 1.1):
        stats = {mn.ACTOR_TOKENS_PER_S: speed * scale}
        if per_verify is not None:
            stats |= {
                mn.SPEC_MEAN_ACCEPTED_LEN: per_verify * scale,
                mn.SPEC_ACCEPTANCE_RATE: 0.5,
                f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}1": 0.7,
                f"{mn.SPEC_DRAFT_LEN_PREFIX}4": 1.0,
            }
        out.append(stats)
    return out


def test_the_real_sections_eagle_keys_from_the_rows_figures():
    k = 4
    rows = rollout_real.methods(k, 6) | eagle_rows.methods(k)
    assert rows["eagle3"].method == rows["eagle3_adaptive"].method == "eagle3"
    assert not rows["eagle3"].adaptive and rows["eagle3_adaptive"].adaptive
    flat: dict[str, object] = {}
    lines = []
    speeds = {1: 0.95, 8: 1.3, 32: 1.1}  # eagle3_adaptive over none by batch
    for batch in rollout_real.BATCHES:
        engines = {name: (None, epochs(100.0, 2.0)) for name in rows}
        engines["none"] = (None, epochs(100.0))
        engines["eagle3"] = (None, epochs(150.0, 3.2))
        engines["eagle3_adaptive"] = (None, epochs(100.0 * speeds[batch], 3.0))
        lines += rollout_real._batch_figures(flat, engines, batch, k)
    rollout_real._summarise(flat)
    reads = eagle_rows.param_reads(tiny(True))
    flat.update(eagle_rows.summary(flat, reads, k, rollout_real.BATCHES))
    assert any("| eagle3 k=4 |" in line for line in lines)
    assert any("| eagle3 adaptive (k<=4) |" in line for line in lines)
    assert flat["real_eagle_tokens_per_verify_b8"] == 3.2
    assert flat["real_eagle_adaptive_min_ratio"] == 0.95
    assert flat["real_best_method_b8"] == "eagle3" and flat["real_speedup_b8"] == 1.5
    frac = flat["real_eagle_draft_param_frac"]
    assert 0 < frac < 1
    assert frac == pytest.approx(reads["eagle_draft_token"] / reads["target_forward"], abs=1e-5)
    assert 0 < flat["real_eagle_draft_param_frac_fc_amortised"] < frac
    assert flat["real_eagle_membound_bound_b8"] == pytest.approx(3.2 / (1 + k * frac), rel=1e-3)
    assert "bound" in flat["real_eagle_membound_bound_is"]
    adapter_frac = flat["real_adapter_draft_param_frac"]
    assert flat["real_adapter_membound_bound_b8"] == pytest.approx(
        2.0 / (1 + k * adapter_frac), rel=1e-3
    )
    # The adapter family's adaptive minimum is unchanged by the head's rows.
    assert flat["real_adaptive_min_ratio"] == 1.0
    assert flat["real_eagle_conditional_acceptance_by_pos"] == [0.7]
    assert "real_eagle_warmup_s" not in flat  # no warm-start summary given


def test_conditional_acceptance_divides_each_position_by_the_one_before():
    assert eagle_rows.conditional([0.8, 0.4, 0.1, 0.05]) == [0.8, 0.5, 0.25, 0.5]
    assert eagle_rows.conditional([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]
    assert eagle_rows.conditional([]) == []


def test_the_warm_start_summary_gives_its_seconds_and_tokens():
    flat = {
        "real_eagle3_b8_tokens_per_verify": 2.0,
        "real_eagle3_adaptive_b8_ratio": 1.1,
        "real_eagle_warmup": {"seconds": 1500.5, "train_tokens": 120_000, "threads": 2},
    }
    out = eagle_rows.summary(flat, eagle_rows.param_reads(tiny(True)), 4, [8])
    assert out["real_eagle_warmup_s"] == 1500.5 and out["real_eagle_warmup_tokens"] == 120_000


def test_the_drift_interval_brackets_the_ratio_and_narrows_with_prompts():
    rng = torch.Generator().manual_seed(0)

    def prompts(n: int, mean: float) -> list[tuple[float, int]]:
        acc = (mean + 0.1 * torch.randn(n, generator=rng)).clamp(0, 1)
        return [(float(a) * 100, 100) for a in acc]

    before, after = prompts(64, 0.5), prompts(64, 0.55)
    ratio = eagle_rows.pooled(after) / eagle_rows.pooled(before)
    low, high = eagle_rows.ratio_ci95(after, before)
    assert low < ratio < high and high - low < 0.2
    wide = eagle_rows.ratio_ci95(after[:8], before[:8])
    assert wide[1] - wide[0] > high - low
    # The same prompts before and after: a ratio of exactly 1 every resample.
    assert eagle_rows.ratio_ci95(before, before) == [1.0, 1.0]
    with pytest.raises(ValueError, match="same prompts"):
        eagle_rows.ratio_ci95(after[:3], before)


def test_the_preset_directory_gets_the_head_the_way_it_gets_the_adapter(tmp_path, monkeypatch):
    model_dir = tmp_path / "smollm2"
    (model_dir / "draft").mkdir(parents=True)
    monkeypatch.setattr(real_preset, "preset_dir", lambda preset: model_dir)
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kwargs: ran.append(cmd))
    (model_dir / DRAFT_FILE).write_text("adapter")
    assert real_preset.real_model_dir() == model_dir
    # Only the head is missing: one warm-draft, the adapter's command with spec=eagle3.
    assert [cmd[1:] for cmd in ran] == [
        ["-m", "ops.cli", "warm-draft", *real_preset.OVERRIDES, "spec=eagle3"]
    ]
    ran.clear()
    (model_dir / EAGLE_FILE).parent.mkdir()
    (model_dir / EAGLE_FILE).write_text("head")
    real_preset.real_model_dir()
    assert ran == []  # a directory that has both keeps them


def test_the_torch_rows_are_exact_and_the_wrong_q_control_is_not():
    figures = eagle_rows.lossless(quick=True)
    assert figures["real_eagle_lossless"] is True
    assert figures["real_eagle_lossless_control_pvalue"] < eagle_rows.PVALUE_MIN
    pvalues = {k: v for k, v in figures.items() if "_pvalue_" in k}
    assert len(pvalues) == 4 and min(pvalues.values()) >= eagle_rows.PVALUE_MIN
    for key, value in figures.items():
        if "_acceptance_" in key:
            assert 0.05 < value < 1.0, key  # drafts accepted and rejected


def test_the_vllm_rows_step_cost_and_ratio():
    steps = {"vllm_plain": [0.01, 0.02, 0.02, 0.5], "vllm_eagle": [0.03, 0.03, 0.04, 0.9]}
    stats = {
        mn.SPEC_MEAN_ACCEPTED_LEN: 3.0,
        mn.SPEC_ACCEPTANCE_RATE: 0.5,
        f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}1": 0.8,
        f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}2": 0.6,
    }
    figures = engines_eagle.batch_figures(
        8, {"vllm_plain": 100.0, "vllm_eagle": 150.0}, steps, stats, 4
    )
    assert figures["real_vllm_eagle_over_vllm_plain_b8"] == 1.5
    assert figures["real_vllm_eagle_b8_step_cost"] == pytest.approx(0.035 / 0.02, rel=1e-3)
    assert figures["real_vllm_eagle_b8_step_cost_from_throughput"] == 2.0
    assert figures["real_vllm_eagle_b8_acceptance_by_pos"] == [0.8, 0.6, 0.0, 0.0]
    summary = engines_eagle.summary(figures)
    assert summary["real_vllm_eagle_tokens_per_verify_b8"] == 3.0
    assert math.isfinite(figures["real_vllm_eagle_b8_step_s_median"])


@pytest.mark.vllm
def test_the_vllm_native_head_is_exact_and_the_rotated_q_control_is_not():
    pytest.importorskip("vllm")
    gc.collect()  # dead engines go before this one starts (tests/engine_vllm/conftest.py)
    figures = engines_eagle.lossless(quick=True)
    assert figures["real_vllm_eagle_lossless"] is True
    assert figures["real_vllm_eagle_lossless_control_pvalue"] < eagle_rows.PVALUE_MIN
    assert figures["real_vllm_eagle_lossless_acceptance_t1.0_p1.0"] > 0.05
    # StepClock timed the engine's steps (what the speed rows' step cost reads).
    assert figures["real_vllm_eagle_lossless_engine_steps"] > 0


def test_the_held_out_wording_rows_report_both_drafts(monkeypatch):
    from common.config import load_config
    from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer

    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = tiny(True)
    monkeypatch.setattr(eagle_rows, "WORDING_PROMPTS", 2)
    cfg = load_config(["task.max_new_tokens=6"])
    rows = rollout_real.methods(3, 1) | eagle_rows.methods(3)
    # The tiny model's vocabulary has no capitals: each character's code point modulo V.
    import common.prompts

    monkeypatch.setattr(
        common.prompts, "prompt_encoder", lambda *a: lambda text: [ord(c) % V for c in text[:24]]
    )
    out = eagle_rows.wording_figures(model, tokenizer, cfg, rows)
    assert out["real_heldout_wording_prompts"] == 2
    for prefix in ("real_eagle", "real_adapter"):
        assert out[f"{prefix}_heldout_wording_tokens_per_verify_b8"] >= 1.0
        assert len(out[f"{prefix}_heldout_wording_acceptance_by_pos"]) <= 3
