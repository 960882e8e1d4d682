"""The learner on multi-turn episodes (protocol v2): only sampled tokens are trained.

An episode's environment and glue tokens (version -1) are context, never loss targets; lengths
that the algorithms use (DAPO's overlong penalty, seq_mean, GSPO's sequence ratio) count
sampled tokens; the group version is the oldest sampled token's; WAL replay and checkpoints
carry v2 groups.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.link.protocol import Completion, DecodeLimits, TrajectoryGroup, decode, encode
from common.link.receive.admission import Admission
from common.link.receive.wal import WalWriter, replay
from common.sampling import processed_logprobs
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import RewardShaping, collate, sampled_count, shaped_rewards
from learner.buffer import StalenessBuffer
from learner.checkpoint import TRAINING_DIR, TrainerState, load_pending, write_training_state
from learner.microbatch import row_lengths
from learner.step import Trainer
from testing.groups import group_of
from testing.models import tiny_model

VOCAB = CharTokenizer(BUILTIN_ALPHABET).vocab_size
CPU = torch.device("cpu")
LIMITS = DecodeLimits(vocab_size=VOCAB)


def episode(rng: np.random.Generator, version: int, turns: int, finished: bool) -> Completion:
    """``turns`` model turns of 1-3 sampled tokens (turn j at ``version + j % 2``) with 1-3
    environment tokens between them; random ids and log-probs."""
    versions: list[int] = []
    starts: list[int] = []
    for j in range(turns):
        if j:
            versions += [-1] * int(rng.integers(1, 4))
        starts.append(len(versions))
        versions += [version + j % 2] * int(rng.integers(1, 4))
    v = np.array(versions, np.int32)
    return Completion(
        token_ids=rng.integers(3, VOCAB, len(v)).astype(np.int32),
        behaviour_logprobs=np.where(v >= 0, -rng.random(len(v)) * 3, 0.0).astype(np.float32),
        token_versions=v,
        reward=float(rng.normal()),
        finished=finished,
        turn_starts=np.array(starts, np.int32),
        turn_rewards=rng.normal(size=turns).astype(np.float32),
        stop="env_done" if finished else "max_turns",
    )


def episode_groups(
    n: int = 2, g: int = 4, version: int = 3, seed: int = 0
) -> list[TrajectoryGroup]:
    """``n`` groups of ``g`` episodes (1-3 turns, every other one unfinished), passed through
    the wire codec: what the learner really receives."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(n):
        completions = [episode(rng, version, 1 + (i + j) % 3, bool(j % 2)) for j in range(g)]
        group = group_of(rng, i, completions, VOCAB, version)
        decoded = decode(encode(group), LIMITS)
        assert isinstance(decoded, TrajectoryGroup)
        groups.append(decoded)
    return groups


def test_the_mask_is_the_sampled_tokens_at_their_offsets() -> None:
    groups = episode_groups()
    batch = collate(groups, learner_version=5, pad_id=0, device=CPU)
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    assert any((c.token_versions < 0).any() for _, c in rows), "no environment token to test"
    for i, (prompt, c) in enumerate(rows):
        p, t = len(prompt), len(c.token_ids)
        expected = torch.zeros(batch.mask.shape[1])
        expected[[p - 1 + k for k in range(t) if c.token_versions[k] >= 0]] = 1.0
        assert torch.equal(batch.mask[i], expected)
        # Environment tokens stay in the context, and carry no behaviour log-prob.
        assert batch.input_ids[i, p : p + t].tolist() == c.token_ids.tolist()
        assert (batch.behaviour_logprobs[i][expected == 0] == 0).all()
    assert batch.num_tokens == sum(sampled_count(c) for _, c in rows)
    # An episode ends on a sampled token: trimming after the last masked position loses nothing.
    assert row_lengths(batch) == [len(p) + len(c.token_ids) for p, c in rows]
    assert batch.staleness.tolist() == [2, 2]


def test_overlong_mask_leaves_unfinished_episodes_out() -> None:
    groups = episode_groups()
    plain = collate(groups, 3, 0, CPU)
    masked = collate(groups, 3, 0, CPU, RewardShaping(overlong="mask"))
    finished = torch.tensor([c.finished for g in groups for c in g.completions])
    assert finished.any() and not finished.all()
    assert torch.equal(masked.mask[finished], plain.mask[finished])
    assert (masked.mask[~finished] == 0).all()


def test_the_overlong_penalty_counts_sampled_tokens_only() -> None:
    rng = np.random.default_rng(1)
    group = episode_groups(n=1, g=4)[0]
    # Many environment tokens between two sampled turns of 2 tokens each: 4 sampled, 24 in all.
    c = group.completions[0]
    c.token_versions = np.array([3, 3] + [-1] * 20 + [4, 4], np.int32)
    c.token_ids = rng.integers(3, VOCAB, 24).astype(np.int32)
    c.behaviour_logprobs = np.where(c.token_versions >= 0, -0.5, 0.0).astype(np.float32)
    c.turn_starts = np.array([0, 22], np.int32)
    c.turn_rewards = np.zeros(2, np.float32)
    c.reward = 1.0
    assert sampled_count(c) == 4
    shaping = RewardShaping(overlong="penalty", max_new_tokens=5, buffer=2, penalty=0.5)
    rewards = shaped_rewards([group], shaping)
    # 4 sampled tokens: 1 into the 2-token buffer before 5, so half the ramp: -0.25. Counting
    # all 24 tokens would give the full -0.5.
    assert rewards[0, 0].item() == pytest.approx(1.0 - 0.25)
    for j, other in enumerate(group.completions[1:], start=1):
        n = sampled_count(other)
        assert rewards[0, j].item() == pytest.approx(other.reward + shaping.length_penalty(n))


def hand_loss(model: torch.nn.Module, groups: list[TrajectoryGroup], cfg: LearnerConfig,
              agg_tokens: float) -> torch.Tensor:  # fmt: skip
    """The PPO-clip (dual-clip) loss of ``cfg`` over the sampled tokens only, written out from
    the episodes themselves (not from the batch's mask): one full-logits forward, GRPO
    advantages, token or sequence ratios, token_mean / seq_mean / seq_sum aggregation."""
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    width = max(len(p) + len(c.token_ids) for p, c in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c.token_ids)] = torch.tensor([*p.tolist(), *c.token_ids.tolist()])
    n_layers = model.args.num_hidden_layers
    logits = model.head(model.run_layers(model.model.embed_tokens(ids), None, None, 0, n_layers))
    lp = processed_logprobs(logits.float(), 1.0)  # [B, S, V]
    rewards = torch.tensor([[c.reward for c in g.completions] for g in groups])
    mean, std = rewards.mean(-1, keepdim=True), rewards.std(-1, keepdim=True, unbiased=False)
    advantages = ((rewards - mean) / (std + 1e-6)).reshape(-1)
    per_row, counts = [], []
    for i, (p, c) in enumerate(rows):
        picks = [k for k in range(len(c.token_ids)) if c.token_versions[k] >= 0]
        log_ratio = torch.stack(
            [lp[i, len(p) - 1 + k, int(c.token_ids[k])] - float(c.behaviour_logprobs[k]) for k in picks]
        )  # fmt: skip
        if cfg.ratio_level == "sequence":
            log_ratio = log_ratio.mean().expand(len(picks))
        ratio, a = log_ratio.exp(), advantages[i]
        s = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a)
        if a < 0:
            s = torch.maximum(s, torch.full_like(s, cfg.dual_clip * float(a)))
        per_row.append(s.sum())
        counts.append(len(picks))
    total = torch.stack(per_row)
    if cfg.loss_agg == "token_mean":
        return -total.sum() / sum(counts)
    if cfg.loss_agg == "seq_mean":
        return -(total / torch.tensor(counts, dtype=torch.float32)).sum() / len(rows)
    return -total.sum() / (len(rows) * agg_tokens)


def sgd_delta(model: torch.nn.Module, batch, cfg: LearnerConfig, **kw) -> tuple[dict, dict]:
    """Parameter change of one plain-SGD step (lr 1, no clipping): minus the step's gradient."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = Trainer(model, optimizer, cfg, SamplingConfig(), **kw).step(batch)
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, metrics  # fmt: skip


@pytest.mark.parametrize(
    ("loss_agg", "ratio_level"),
    [("token_mean", "token"), ("seq_mean", "token"), ("seq_sum", "token"), ("token_mean", "sequence")],
)  # fmt: skip
def test_the_policy_loss_and_its_gradient_are_the_sampled_tokens_by_hand(
    loss_agg: str, ratio_level: str
) -> None:
    model = tiny_model(VOCAB)
    groups = episode_groups()
    cfg = LearnerConfig(
        grad_clip=0.0, loss_agg=loss_agg, ratio_level=ratio_level, loss_agg_tokens=7
    )
    delta, metrics = sgd_delta(model, collate(groups, 3, 0, CPU), cfg)
    reference = copy.deepcopy(model)
    loss = hand_loss(reference, groups, cfg, agg_tokens=7.0)
    loss.backward()
    assert metrics["learner/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(delta[name], -p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_draft_co_training_loss_reads_sampled_positions_only() -> None:
    """The early exit's KL (and the adapter's and EAGLE head's, which take the same ``mask > 0``
    positions in learner/step.py) averages over sampled positions: here by hand."""
    model = tiny_model(VOCAB)
    groups = episode_groups()
    spec = SpecConfig(method="early_exit", exit_layer=1, aux_coef=0.5)
    batch = collate(groups, 3, 0, CPU)
    _, metrics = sgd_delta(model, batch, LearnerConfig(grad_clip=0.0), spec=spec)
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    with torch.no_grad():
        h_exit = model.run_layers(model.model.embed_tokens(batch.input_ids), None, None, 0, 1)
        full = model.head(model.run_layers(h_exit, None, None, 1, model.args.num_hidden_layers))
        p, q = (
            processed_logprobs(full.float(), 1.0),
            processed_logprobs(model.head(h_exit).float(), 1.0),
        )
        kl = (p.exp() * (p - q)).sum(-1)  # [B, S]
    picks = [(i, len(pr) - 1 + k) for i, (pr, c) in enumerate(rows) for k in range(len(c.token_ids)) if c.token_versions[k] >= 0]  # fmt: skip
    expected = sum(float(kl[i, t]) for i, t in picks) / len(picks)
    assert metrics["spec/exit_kl"] == pytest.approx(expected, rel=1e-4)


def test_an_environment_tokens_target_changes_nothing() -> None:
    """Only the target at an environment position changes (the context stays): the update is
    bit-identical. Were environment tokens trained, it would move with the target."""
    model = tiny_model(VOCAB)
    groups = episode_groups()
    batch = collate(groups, 3, 0, CPU)
    prompt, c = groups[0].prompt_ids, groups[0].completions[2]  # row 2: 3 turns
    k = int(np.flatnonzero(c.token_versions < 0)[0])
    row, pos = 2, len(prompt) - 1 + k
    assert batch.mask[row, pos] == 0 and batch.targets[row, pos] == int(c.token_ids[k])
    changed = copy.copy(batch)
    changed.targets = batch.targets.clone()
    changed.targets[row, pos] = (int(c.token_ids[k]) + 1) % VOCAB
    cfg = LearnerConfig(grad_clip=0.0)
    a, ma = sgd_delta(model, batch, cfg)
    b, mb = sgd_delta(model, changed, cfg)
    assert ma["learner/loss"] == mb["learner/loss"]
    assert all(torch.equal(a[n], b[n]) for n in a)
    # The control: the same change at a sampled position does move the update.
    sampled_pos = len(prompt) - 1 + int(np.flatnonzero(c.token_versions >= 0)[-1])
    control = copy.copy(batch)
    control.targets = batch.targets.clone()
    control.targets[row, sampled_pos] = (int(control.targets[row, sampled_pos]) + 1) % VOCAB
    assert not all(torch.equal(a[n], d) for n, d in sgd_delta(model, control, cfg)[0].items())


def test_version_ahead_and_staleness_go_by_sampled_tokens() -> None:
    [group] = episode_groups(n=1, g=4, version=3)
    newest = max(int(c.token_versions.max()) for c in group.completions)
    assert newest == 4 and group.version == 3
    admission = Admission(group_size=4, max_seq_tokens=256, max_abs_reward=100.0)
    assert admission.refusal(group, latest_version=4) is None
    assert admission.refusal(group, latest_version=3).reason == "version_ahead"
    buffer = StalenessBuffer(max_staleness=2, admission=admission)
    assert buffer.admit(group, learner_version=5)
    assert not buffer.admit(group, learner_version=6)


def test_wal_replay_and_checkpoint_pending_carry_v2_groups(tmp_path: Path) -> None:
    groups = episode_groups()
    frames = [encode(g) for g in groups]
    wal = WalWriter(tmp_path / "wal")
    for frame in frames:
        wal.append(frame)
    wal.close()
    replayed = replay(tmp_path / "wal", 0, LIMITS)
    assert [encode(g) for g in replayed] == frames
    assert replayed[0].completions[0].stop is not None
    checkpoint = tmp_path / "step_00000001"
    (checkpoint / TRAINING_DIR).mkdir(parents=True)
    write_training_state(checkpoint / TRAINING_DIR, TrainerState(1, 1), [], groups)
    assert [encode(g) for g in load_pending(checkpoint, LIMITS)] == frames
