"""The algorithm options of the policy loss, each against a small batch computed by hand, and
the default (GRPO) loss against the formula it had before the options (bit-identical).

Batch of the loss tests: two sequences, behaviour log-probs 0, so each ratio is exp(logprob):
row 0 (A = +1): ratios 1.5, 0.5 (third position padding);
row 1 (A = -1): ratios 1.0, 2.0, 0.9.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.loss import LossOptions, Sequences, grpo_advantages, ppo_clip_loss

RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.0, 2.0, 0.9]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)


def loss_of(options=None, adv=(1.0, -1.0), clip_eps=0.2, dual_clip=3.0, ratios=RATIOS):
    logprobs = ratios.log().clone().requires_grad_(True)
    out = ppo_clip_loss(
        logprobs=logprobs,
        behaviour_logprobs=torch.zeros_like(logprobs),
        advantages=torch.tensor(adv, dtype=torch.float64),
        mask=MASK,
        clip_eps=clip_eps,
        dual_clip=dual_clip,
        options=options,
    )
    return out, logprobs


def old_ppo_clip_loss(logprobs, behaviour, advantages, mask, clip_eps, dual_clip, ref, kl_coef):
    """The loss as it was before the algorithm options (copied, not imported)."""
    mask = mask.float()
    n_tokens = mask.sum().clamp(min=1.0)
    adv = advantages.detach().unsqueeze(-1)
    log_ratio = (logprobs - behaviour).clamp(max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    truncated = (adv < 0) & (surrogate < dual_clip * adv)
    surrogate = torch.where(truncated, dual_clip * adv, surrogate)
    pg_loss = -(surrogate * mask).sum() / n_tokens
    delta = ref.detach() - logprobs
    kl = ((torch.exp(delta) - delta - 1.0) * mask).sum() / n_tokens
    return pg_loss + kl_coef * kl


def test_default_loss_equals_the_old_formula_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(6, 9, generator=g) * 0.3 - 1.0).requires_grad_(True)
    behaviour = torch.randn(6, 9, generator=g) * 0.3 - 1.0
    ref = torch.randn(6, 9, generator=g) * 0.3 - 1.0
    adv = torch.randn(6, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    new = ppo_clip_loss(lp, behaviour, adv, mask, 0.2, 3.0, ref, 0.05, options=LossOptions(0.2))
    old = old_ppo_clip_loss(lp, behaviour, adv, mask, 0.2, 3.0, ref, 0.05)
    assert torch.equal(new.loss, old)
    (g_new,) = torch.autograd.grad(new.loss, lp, retain_graph=True)
    (g_old,) = torch.autograd.grad(old, lp)
    assert torch.equal(g_new, g_old)
    rewards = torch.randn(4, 8, generator=g)
    mean, std = rewards.mean(-1, keepdim=True), rewards.std(-1, keepdim=True, unbiased=False)
    assert torch.equal(grpo_advantages(rewards), (rewards - mean) / (std + 1e-6))


def test_token_mean_by_hand():
    # Row 0: min(1.5, 1.2) = 1.2, min(0.5, 0.8) = 0.5. Row 1: -1, min(-2, -1.2) = -2, -0.9.
    out, _ = loss_of()
    assert out.pg_loss.item() == pytest.approx(-(1.2 + 0.5 - 1.0 - 2.0 - 0.9) / 5)


def test_sequence_mean_by_hand():
    # Row 0: (1.2 + 0.5) / 2 = 0.85; row 1: -3.9 / 3 = -1.3; mean over the two: -0.225.
    out, _ = loss_of(LossOptions(aggregation="seq_mean"))
    assert out.pg_loss.item() == pytest.approx(0.225)


def test_length_unbiased_sum_by_hand():
    # Dr.GRPO: sum of the token terms (-2.2) over 2 sequences x the constant 4.
    out, _ = loss_of(LossOptions(aggregation="seq_sum", agg_tokens=4.0))
    assert out.pg_loss.item() == pytest.approx(2.2 / 8)


def test_clip_higher_by_hand():
    # [1 - 0.2, 1 + 0.28]: row 0's 1.5 now counts 1.28; row 1's min(-2, -1.28) is still -2.
    out, _ = loss_of(LossOptions(clip_high=0.28))
    assert out.pg_loss.item() == pytest.approx(-(1.28 + 0.5 - 1.0 - 2.0 - 0.9) / 5)


def test_truncated_importance_sampling_by_hand_and_against_the_dual_clip():
    # C = 1.5: row 1's ratio 2 (A = -1, unclipped branch) counts min(2, 1.5) * -1 = -1.5, and
    # its gradient d(-term / 5)/d logprob is -A * C / 5 = 0.3 (without TIS: -A * 2 / 5 = 0.4).
    out, lp = loss_of(LossOptions(tis_cap=1.5))
    assert out.pg_loss.item() == pytest.approx(-(1.2 + 0.5 - 1.0 - 1.5 - 0.9) / 5)
    out.loss.backward()
    assert lp.grad[1, 1].item() == pytest.approx(0.3)
    plain, lp = loss_of()
    plain.loss.backward()
    assert lp.grad[1, 1].item() == pytest.approx(0.4)
    # The dual clip at 1.8 bounds the same token at 1.8 * A, a constant: no gradient.
    dual, lp = loss_of(dual_clip=1.8)
    dual.loss.backward()
    assert dual.pg_loss.item() == pytest.approx(-(1.2 + 0.5 - 1.0 - 1.8 - 0.9) / 5)
    assert lp.grad[1, 1].item() == 0.0
    assert dual.truncated_frac.item() == pytest.approx(1 / 5)


def test_sequence_ratio_by_hand():
    # GSPO: s0 = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75), s1 = (1.0 * 2.0 * 0.9) ** (1/3).
    s0, s1 = math.sqrt(0.75), 1.8 ** (1 / 3)
    # clip 0.5: nothing clipped; row 0 (A = -1) -s0, row 1 (A = +1) s1; mean over sequences.
    out, lp = loss_of(LossOptions(ratio_level="sequence", aggregation="seq_mean"), (-1.0, 1.0), 0.5)
    assert out.pg_loss.item() == pytest.approx(-(-s0 + s1) / 2)
    # The gradient reaches every token of a sequence equally: d/d lp_t of -(s1 / 2) is
    # -(s1 / 2) / 3 for each of row 1's three tokens.
    out.loss.backward()
    assert lp.grad[1].tolist() == pytest.approx([-s1 / 6] * 3)
    assert lp.grad[0, :2].tolist() == pytest.approx([s0 / 4] * 2)
    # clip 0.1: both sequences clipped, as wholes: row 0 min(-s0, -0.9) = -0.9, row 1 1.1.
    out, _ = loss_of(LossOptions(ratio_level="sequence", aggregation="seq_mean"), (-1.0, 1.0), 0.1)
    assert out.pg_loss.item() == pytest.approx(-(-0.9 + 1.1) / 2)
    assert out.clip_frac.item() == pytest.approx(1.0)


def test_flattened_tokens_with_sequence_ids_give_the_row_values():
    """The step passes its tokens flattened ([N, 1]) with each token's row: same loss."""
    opts = LossOptions(ratio_level="sequence", aggregation="seq_mean", clip_high=0.3)
    by_rows, _ = loss_of(opts, (-1.0, 1.0), 0.1)
    sel = MASK > 0
    ids = torch.tensor([[0, 0, 0], [1, 1, 1]])[sel][:, None]
    lengths = MASK.sum(-1, keepdim=True).expand(2, 3)[sel][:, None]
    flat = ppo_clip_loss(
        logprobs=RATIOS.log()[sel][:, None],
        behaviour_logprobs=torch.zeros(5, 1, dtype=torch.float64),
        advantages=torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0], dtype=torch.float64),
        mask=torch.ones(5, 1, dtype=torch.float64),
        clip_eps=0.1,
        dual_clip=3.0,
        options=opts,
        sequences=Sequences(ids, lengths, 2.0),
    )
    assert flat.pg_loss.item() == pytest.approx(by_rows.pg_loss.item())


def test_advantages_with_and_without_the_std_division():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.5, std 0.5: +-0.5 centred, +-1 normalised; the equal group is all zeros.
    assert grpo_advantages(rewards, std_norm=False).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]
    normed = grpo_advantages(rewards, eps=0.0)
    assert normed[0].tolist() == [1.0, -1.0, -1.0, 1.0]


def _group(rewards, lengths=None, finished=None, seq=0):
    from common.link.protocol import Completion, TrajectoryGroup

    lengths = lengths or [2] * len(rewards)
    finished = finished or [True] * len(rewards)
    completions = [
        Completion(
            token_ids=np.arange(1, n + 1, dtype=np.int32),
            behaviour_logprobs=np.full(n, -0.5, dtype=np.float32),
            token_versions=np.zeros(n, dtype=np.int32),
            reward=r,
            finished=f,
        )
        for r, n, f in zip(rewards, lengths, finished, strict=True)
    ]
    return TrajectoryGroup("a", seq, "p", np.array([5, 6], dtype=np.int32), 0, completions)


def test_overlong_soft_penalty_by_hand():
    from learner.batch import RewardShaping, shaped_rewards

    shaping = RewardShaping(overlong="penalty", max_new_tokens=8, buffer=4, penalty=1.0)
    # Up to 8 - 4 = 4 tokens: 0; 6 tokens: (4 - 6) / 4 = -0.5; 8 tokens: -1.
    assert [shaping.length_penalty(n) for n in (3, 4, 6, 8, 9)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    rewards = shaped_rewards([_group([1.0, 1.0, 1.0], [4, 6, 8])], shaping)
    assert rewards.tolist() == [[1.0, 0.5, 0.0]]
    assert shaped_rewards([_group([1.0, 1.0, 1.0], [4, 6, 8])]).tolist() == [[1.0, 1.0, 1.0]]


def test_overlong_mask_leaves_unfinished_completions_out_of_the_loss():
    from learner.batch import RewardShaping, collate

    group = _group([1.0, 0.0], [2, 3], finished=[True, False])
    masked = collate([group], 0, 0, torch.device("cpu"), RewardShaping(overlong="mask"))
    assert masked.mask.sum(-1).tolist() == [2.0, 0.0]
    plain = collate([group], 0, 0, torch.device("cpu"))
    assert plain.mask.sum(-1).tolist() == [2.0, 3.0]


def test_dynamic_sampling_skips_groups_without_signal_and_fills_the_step():
    from common.link.receive.admission import Admission
    from learner.batch import has_signal
    from learner.buffer import StalenessBuffer

    groups = [
        _group([1.0, 1.0], seq=0),
        _group([1.0, 0.0], seq=1),
        _group([0.0, 0.0], seq=2),
        _group([0.0, 0.5], seq=3),
        _group([1.0, 0.0], seq=4),
    ]
    queue = list(groups)
    buffer = StalenessBuffer(2, Admission(2, 64, 10.0), signal=has_signal)
    got = buffer.collect(lambda _t: queue.pop(0) if queue else None, 2, 0, 5.0)
    assert [g.seq for g in got] == [1, 3]
    assert buffer.skipped_no_signal == 2
    assert [g.seq for g in queue] == [4]


def test_default_options_are_the_loss_without_options():
    lp = torch.randn(3, 4).requires_grad_(True)
    args = (lp, torch.randn(3, 4), torch.randn(3), torch.ones(3, 4), 0.2, 3.0)
    assert torch.equal(ppo_clip_loss(*args).loss, ppo_clip_loss(*args, options=LossOptions()).loss)


def _lrs(schedule, floor=0.1, warmup=3, total=11):
    from dataclasses import replace

    from common.config.learner import LearnerConfig
    from learner.optim import warm_up_lr

    cfg = replace(
        LearnerConfig(), lr=1.0, lr_warmup_steps=warmup, lr_schedule=schedule, lr_min_ratio=floor
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    out = []
    for step in range(total):
        warm_up_lr(opt, cfg, step, total)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_lr_decay_after_the_warm_up_by_hand():
    # Warm-up over 3 steps: 1/3, 2/3, 1 (step 2); then the decay over steps 2..10 (8 steps).
    linear = _lrs("linear")
    assert linear[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    # Step 4: progress 2/8; linear 1 - 0.9 * 0.25; step 10: the floor 0.1.
    assert linear[4] == pytest.approx(0.775)
    assert linear[10] == pytest.approx(0.1)
    cosine = _lrs("cosine")
    assert cosine[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine[6] == pytest.approx(0.55)
    assert cosine[10] == pytest.approx(0.1)
    assert _lrs("constant") == pytest.approx([1 / 3, 2 / 3] + [1.0] * 9)
    # No warm-up: the decay starts at step 0 (progress step / 10), to 0 here.
    assert _lrs("linear", floor=0.0, warmup=0)[5] == pytest.approx(0.5)
