"""The episode runner (actors/episodes/runner.py) on the torch engine's serve, a tiny char model and
in-process environments: what an episode's completion holds (masks, versions, turn starts, stops),
what the environment saw, budgets, and environments that fail."""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.engines.torch.engine import TorchEngine
from actors.episodes.env import CheckedEnv, make_env
from actors.episodes.runner import EpisodeRunner
from common import metric_names as mn
from common.chat_bridge import make_bridge
from common.config.actor import SpecConfig
from common.config.env import EnvConfig
from common.link.protocol import DecodeLimits, TrajectoryGroup, decode, encode
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from testing.models import random_model

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
EOS = TOKENIZER.eos_id


class Echo:
    """Answers each action with ``=<its first 3 characters>>``; done after ``turns`` turns with
    the reward of the action's length; can fail on a given turn."""

    def __init__(self, turns: int = 2, fail_on: int = 0, differ: bool = False) -> None:
        self.turns, self.fail_on, self.differ = turns, fail_on, differ
        self.n, self.sibling = 0, 0

    def reset(self, *, seed, options):
        self.n, self.sibling = 0, options["sibling"]
        start = f"go {seed % 10}" + ("x" * self.sibling if self.differ else "")
        return start + ">", {}

    def step(self, action):
        self.n += 1
        if self.n == self.fail_on:
            raise RuntimeError("the environment broke")
        return f"={action[:3]}>", float(len(action)), self.n >= self.turns, False, {}


def valid(group: TrajectoryGroup) -> bool:
    """The group as the learner decodes it (protocol v2 checks) equals what was sent."""
    again = decode(encode(group), DecodeLimits(vocab_size=TOKENIZER.vocab_size))
    return encode(again) == encode(group)


def runner(factory, spec: SpecConfig | None = None, inflight: str = "verify_on_swap", **fields):
    """A runner over a random tiny char model (version 0) and ``factory``'s environments."""
    model = random_model(TOKENIZER.vocab_size, seed=3)
    engine = TorchEngine(
        model,
        EOS,
        TOKENIZER.pad_id,
        1.0,
        seed=7,
        version=0,
        max_rows=8,
        spec=spec,
        inflight=inflight,
    )
    cfg = EnvConfig(name="echo:Echo", workers=0, max_turn_tokens=6, **fields)
    bridge = make_bridge(TOKENIZER, max_obs_chars=cfg.max_obs_chars, max_obs_tokens=64)
    make = lambda: CheckedEnv(factory(), name="echo")  # noqa: E731
    return EpisodeRunner(engine, cfg, bridge, TOKENIZER, make, frozenset({EOS}))


def test_an_episode_is_its_turns_and_the_environments_tokens_marked():
    run = runner(lambda: Echo(turns=2))
    groups = []
    episodes = run.run_batch([11, 12], 3, None, groups.append)
    assert len(groups) == 2
    for group, row in zip(sorted(groups, key=lambda g: g.prompt_id), episodes, strict=True):
        assert valid(group)  # a valid v2 frame
        prompt = [TOKENIZER.bos_id, *TOKENIZER.encode(f"go {row[0].problem + 1}>")]
        assert group.prompt_ids.tolist() == prompt
        for completion, ep in zip(group.completions, row, strict=True):
            versions = completion.token_versions
            assert ep.stop == "env_done" and completion.finished
            starts = completion.turn_starts.tolist()
            assert starts[0] == 0 and versions[0] == 0 and versions[-1] == 0
            # Every environment token is marked and has log-prob 0; each model turn's tokens
            # are sampled ones and decode to exactly what the environment was given.
            env = versions < 0
            assert np.all(completion.behaviour_logprobs[env] == 0.0)
            bounds = [*starts, len(versions)]
            for turn, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
                sampled = np.flatnonzero(versions[a:b] >= 0) + a
                ids = completion.token_ids[sampled].tolist()
                assert TOKENIZER.decode([t for t in ids if t != EOS]) == ep.seen[turn]
                if turn + 1 < len(starts):  # the observation after it, as the bridge wrote it
                    obs = completion.token_ids[a:b][versions[a:b] < 0].tolist()
                    tail = [EOS] if ids[-1] != EOS else []  # the glue of a cut turn
                    assert obs == tail + TOKENIZER.encode(f"={ep.seen[turn][:3]}>")
            assert completion.reward == pytest.approx(sum(len(s) for s in ep.seen))
            assert completion.turn_rewards.tolist() == [float(len(s)) for s in ep.seen]
    assert run.counts[f"{mn.ENV_STOP_PREFIX}env_done"] == 6


def test_budgets_end_episodes_before_the_engine_would_refuse_them():
    run = runner(lambda: Echo(turns=50), max_turns=3, max_total_tokens=40, max_obs_tokens=16)
    groups = []
    episodes = run.run_batch([5], 2, None, groups.append)
    for ep in episodes[0]:
        assert ep.stop in ("max_turns", "context")
        assert len(ep.prompt_ids) + len(ep.stream) <= 40
        assert len(ep.turn_starts) <= 3
    [group] = groups
    for completion in group.completions:
        assert completion.token_versions[-1] >= 0  # ends on a model token
        assert not completion.finished


def test_a_failing_environment_drops_its_group_or_scores_zero():
    run = runner(lambda: Echo(turns=3, fail_on=2))
    groups = []
    run.run_batch([1, 2], 2, None, groups.append)
    assert groups == []
    assert run.counts[mn.ENV_GROUPS_DROPPED] == 2
    assert run.counts[f"{mn.ENV_FAILURES_PREFIX}raised"] == 4
    run = runner(lambda: Echo(turns=3, fail_on=2), on_failure="zero", failure_reward=-1.0)
    run.run_batch([1], 2, None, groups.append)
    [group] = groups
    assert [c.reward for c in group.completions] == [-1.0, -1.0]
    assert [c.stop for c in group.completions] == ["env_error", "env_error"]
    assert valid(group)


def test_siblings_whose_first_observations_differ_are_refused():
    run = runner(lambda: Echo(differ=True))
    groups = []
    run.run_batch([3], 2, None, groups.append)
    assert groups == [] and run.counts[mn.ENV_RESET_MISMATCH] == 1


def test_the_builtin_lookup_runs():
    model = random_model(TOKENIZER.vocab_size, seed=3)
    engine = TorchEngine(model, EOS, TOKENIZER.pad_id, 1.0, seed=7, version=0, max_rows=8)
    bridge = make_bridge(TOKENIZER)
    cfg = EnvConfig(name="lookup", workers=0, max_turn_tokens=8)
    run = EpisodeRunner(
        engine, cfg, bridge, TOKENIZER, lambda: make_env("lookup"), frozenset({EOS})
    )
    groups = []
    run.run_batch([42], 2, None, groups.append)
    [group] = groups
    assert TOKENIZER.decode(group.prompt_ids.tolist()[1:]).startswith("find ")
    assert all(c.stop in ("max_turns", "env_done") for c in group.completions)


@pytest.mark.parametrize("inflight", ["verify_on_swap", "verify_on_finish", "abort"])
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_weights_that_change_during_the_episodes_keep_every_episode_whole(method, inflight):
    """A new version every few decoding steps (delayed verification of the open turns, turns
    admitted after a swap prefilled under it): each turn is delivered once, every group is valid
    and its sampled tokens carry the versions that drew them."""
    spec = SpecConfig(method=method, k=4)
    run = runner(lambda: Echo(turns=3), spec=spec, inflight=inflight)
    model = random_model(TOKENIZER.vocab_size, seed=4)
    polls = [0]

    def weights():
        polls[0] += 1
        if polls[0] % 3:
            return None
        version = polls[0] // 3
        return version, {k: v + 0.01 * version for k, v in model.state_dict().items()}

    groups = []
    episodes = run.run_batch([7, 8, 9], 4, weights, groups.append)
    assert len(groups) == 3 and all(valid(g) for g in groups)
    versions = {int(v) for g in groups for c in g.completions for v in c.token_versions if v >= 0}
    assert len(versions) > 1, versions  # the episodes did span versions
    for row in episodes:
        for ep in row:
            assert ep.stop == "env_done" and len(ep.seen) == len(ep.turn_starts) == 3


class Hangs(Echo):
    """Answers its first turn, then hangs (longer than the step deadline) on the second."""

    def step(self, action):
        if self.n == 1:
            time.sleep(2.0)
        return super().step(action)


def test_a_hung_environment_ends_its_episode_at_the_deadline_and_the_batch_goes_on():
    run = runner(lambda: Hangs(turns=3), step_timeout_s=0.3, on_failure="zero")
    groups = []
    started = time.monotonic()
    episodes = run.run_batch([1], 2, None, groups.append)
    assert time.monotonic() - started < 30
    assert [ep.stop for ep in episodes[0]] == ["env_timeout", "env_timeout"]
    assert run.counts[f"{mn.ENV_FAILURES_PREFIX}timeout"] == 2
    [group] = groups
    assert [c.stop for c in group.completions] == ["env_timeout", "env_timeout"]
    assert all(valid(g) for g in groups)


class Slow(Echo):
    """Echo whose every step takes ``seconds`` (sleeping)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(turns=2)
        self.seconds = seconds

    def step(self, action):
        time.sleep(self.seconds)
        return super().step(action)


def test_a_batch_reports_its_decode_idle_share_and_step_time():
    # One episode: while its environment sleeps the decode loop has no row to decode, so the
    # idle share is about the step time over the batch's time; the mean step covers the sleep.
    run = runner(lambda: Slow(0.2))
    run.run_batch([5], 1, None, lambda group: None)
    assert run.gauges[mn.ENV_STEP_S] >= 0.2
    assert 0.1 < run.gauges[mn.ENV_DECODE_IDLE_FRAC] <= 1.0
    # Eight episodes of a fast environment: the loop is rarely idle.
    run = runner(lambda: Echo(turns=2))
    run.run_batch([1, 2, 3, 4], 2, None, lambda group: None)
    assert 0.0 <= run.gauges[mn.ENV_DECODE_IDLE_FRAC] < 1.0
    assert run.gauges[mn.ENV_STEP_S] < 0.2


class Trailing:
    """Answers every turn with an observation ending in spaces and a newline; done after 3."""

    def __init__(self) -> None:
        self.n = 0

    def reset(self, *, seed, options):
        self.n = 0
        return f"go {seed}", {}

    def step(self, action):
        self.n += 1
        return f"result {self.n}  \n", 0.0, self.n >= 3, False, {}


@pytest.mark.parametrize(("template", "mismatched"), [("chatml", False), ("trims", True)])
def test_check_bridge_always_probes_every_episode_and_counts_differences(
    tmp_path, template, mismatched
):
    # A template that trims a message once it is history passes a probe without trailing
    # whitespace (the start probe is skipped here, as a template it missed would be); with
    # env.check_bridge=always every ended episode's conversation is probed, and each difference
    # is counted, the episode kept.
    from common.tokenizer import HFTokenizer
    from testing.conversations import history_trimming_tokenizer
    from testing.own_model import build_tokenizer

    if template == "chatml":
        build_tokenizer(tmp_path)
        tokenizer = HFTokenizer(tmp_path)
    else:
        tokenizer = history_trimming_tokenizer(tmp_path)
    model = random_model(tokenizer.vocab_size, seed=3)
    engine = TorchEngine(
        model, tokenizer.eos_id, tokenizer.pad_id, 1.0, seed=7, version=0, max_rows=8
    )
    cfg = EnvConfig(name="t:Trailing", max_turn_tokens=4, check_bridge="always")
    bridge = make_bridge(tokenizer, check=False)
    make = lambda: CheckedEnv(Trailing(), name="trailing")  # noqa: E731
    stop_ids = frozenset({tokenizer.eos_id, *bridge.eot_ids})
    run = EpisodeRunner(engine, cfg, bridge, tokenizer, make, stop_ids)
    groups = []
    episodes = run.run_batch([1, 2], 2, None, groups.append)
    probed = sum(len(ep.turn_starts) >= 2 for row in episodes for ep in row)
    # An episode that bridged two observations has the first one trimmed in the full render.
    trimmed = sum(len(ep.turn_starts) >= 3 for row in episodes for ep in row)
    assert trimmed > 0 and len(groups) == 2
    counted = run.counts[mn.ENV_BRIDGE_MISMATCHES]
    assert trimmed <= counted <= probed if mismatched else counted == 0


class Logged(Echo):
    """:class:`Echo` that logs when its episode starts (``reset``) and ends (its last step)."""

    def __init__(self, events: list, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events, self.seed = events, -1

    def reset(self, *, seed, options):
        self.seed = seed
        self.events.append(("start", seed))
        return super().reset(seed=seed, options=options)

    def step(self, action):
        out = super().step(action)
        if out[2]:
            self.events.append(("end", self.seed))
        return out


def test_continuous_admission_keeps_at_most_in_flight_problems_in_one_serve():
    events: list = []
    run = runner(lambda: Logged(events, turns=2))
    serves = []
    serve = run.engine.serve
    run.engine.serve = lambda *args: serves.append(1) or serve(*args)
    groups = []
    seeds = [20, 21, 22, 23, 24, 25]
    episodes = run.run_batch(seeds, 2, None, groups.append, in_flight=2)
    assert len(serves) == 1  # every problem in one decode loop
    assert sorted(g.prompt_id for g in groups) == [f"env-{s}" for s in seeds]
    assert all(valid(g) for g in groups)
    assert [row[0].problem for row in episodes] == list(range(6))
    # Problems live at once (a problem is live from its first reset to its last episode's end):
    # never more than 2, and the later seeds started only as earlier groups ended.
    live, most, ended, group_ends = {}, 0, {s: 0 for s in seeds}, {}
    for at, (kind, seed) in enumerate(events):
        if kind == "start":
            live[seed] = live.get(seed, 0) + 1
        else:
            ended[seed] += 1
            if ended[seed] == 2:
                del live[seed]
                group_ends[seed] = at
        most = max(most, len(live))
    assert most == 2
    assert events.index(("start", 22)) > min(group_ends[20], group_ends[21])


def test_continuous_admission_goes_on_past_a_refused_group():
    # Seed 31's siblings see different first prompts (refused); the seeds after it still run.
    run = runner(lambda: Echo(turns=2, differ=True))
    groups = []
    episodes = run.run_batch([30, 31, 32], 2, None, groups.append, in_flight=1)
    assert groups == [] and run.counts[mn.ENV_RESET_MISMATCH] == 3
    assert len(episodes) == 3 and all(ep.stop == "env_error" for row in episodes for ep in row)
