"""Statistical check of multi-turn episodes through the torch engine's turn-request stream
(``TorchEngine.serve``), with weights changing during an episode (design note §5.2).

The construction: a vocabulary-4 peaky model pair (old, new), no EOS (every turn runs to its
2-token budget, so every episode's turns start and end at the same decoding step), the prompt
``[1, 3, 2]``; turn 1 (2 tokens), then a token-dependent stochastic environment whose
observation is ``[(y1 + y2) % 4, r]`` with ``r = 1`` with probability 0.3 from the environment's
own seeded generator, then turn 2 (2 tokens), then the episode ends. Each episode is one of
16 x 2 x 16 = 512 outcomes whose exact probability is enumerated with plain forwards
(:func:`exact_episode_logprobs`); the engine's episodes are compared with it by a chi-square
goodness-of-fit test.

:class:`Driver` is the episode runner in miniature: it feeds the turn requests to ``serve``,
steps the environment with each finished first turn (logging what it receives) and asks for the
second turn with the whole history as its prompt."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from actors.engines.torch.engine import TorchEngine
from actors.engines.turns import EpisodeDone, TurnQueue, TurnRequest, TurnResult
from common.config.actor import SpecConfig
from common.model import Transformer
from testing.goodness_of_fit import chi_square_pvalue
from testing.lossless_check import NO_EOS, exact_sequence_logprobs, peaky_model
from testing.models import token_logprobs

VOCAB = 4
PROMPT = (1, 3, 2)
TURN_TOKENS = 2
P_REWARD = 0.3
"""Probability of the environment's random observation token being 1."""


def model_pair() -> tuple[Transformer, Transformer]:
    """The old and the new weights: two peaky models over :data:`VOCAB` tokens."""
    return peaky_model(VOCAB, 1, 6.0), peaky_model(VOCAB, 2, 6.0)


def observation(turn: Sequence[int], r: int) -> list[int]:
    """What the environment answers to a first turn, given its random bit ``r``."""
    return [(int(turn[0]) + int(turn[1])) % VOCAB, r]


def exact_episode_logprobs(
    turn1: Transformer, turn2: Transformer, temperature: float = 1.0
) -> dict[tuple[int, ...], float]:
    """log P(y1 + o + y2) of every episode when turn 1 follows ``turn1``'s weights and turn 2
    ``turn2``'s, over the whole history: pi_1(y1 | x) P_env(o | x, y1) pi_2(y2 | x, y1, o)."""
    out: dict[tuple[int, ...], float] = {}
    first = exact_sequence_logprobs(turn1, PROMPT, TURN_TOKENS, temperature, 1.0, NO_EOS)
    for y1, lp1 in first.items():
        for r, p_r in ((0, 1 - P_REWARD), (1, P_REWARD)):
            obs = tuple(observation(y1, r))
            history = (*PROMPT, *y1, *obs)
            second = exact_sequence_logprobs(turn2, history, TURN_TOKENS, temperature, 1.0, NO_EOS)
            for y2, lp2 in second.items():
                out[(*y1, *obs, *y2)] = lp1 + math.log(p_r) + lp2
    return out


@dataclass
class Episode:
    """One episode as the driver saw it: each turn's prompt (the history) and result, and the
    environment's observation."""

    prompts: list[list[int]] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list)
    obs: list[int] = field(default_factory=list)

    def outcome(self) -> tuple[int, ...]:
        """y1 + o + y2."""
        y1, y2 = (t.token_ids.tolist() for t in self.turns)
        return (*y1, *self.obs, *y2)

    def stream(self) -> tuple[list[int], list[int], list[float]]:
        """The episode's token stream after the prompt, its versions (-1: environment tokens)
        and behaviour log-probs (0 for environment tokens)."""
        t1, t2 = self.turns
        tokens = [*t1.token_ids.tolist(), *self.obs, *t2.token_ids.tolist()]
        env = [-1] * len(self.obs)
        versions = [*t1.token_versions.tolist(), *env, *t2.token_versions.tolist()]
        logprobs = [*t1.behaviour_logprobs.tolist(), *([0.0] * len(self.obs))]
        return tokens, versions, [*logprobs, *t2.behaviour_logprobs.tolist()]


class Driver:
    """Feeds ``episodes`` two-turn episodes to ``serve`` through a :class:`TurnQueue`.

    Without ``gate`` the environment steps inside ``on_turn`` (zero latency, on the decode
    thread): every episode's second turn joins the batch at the same step. With ``gate`` the
    driver waits until every first turn is done, then, on its own thread, until ``gate`` is set
    (e.g. by the weight source once it delivered), and only then steps the environments: the
    weights change while every episode waits on its environment."""

    def __init__(
        self,
        episodes: int,
        env_seed: int = 0,
        gate: threading.Event | None = None,
        coupled: bool = False,
    ) -> None:
        self.coupled = coupled
        """Control: episodes 2i and 2i + 1 share one random bit (one environment RNG for two
        siblings): each episode's law stays exact, the pair's is no longer the product."""
        self.shared_bits: dict[int, int] = {}
        self.queue = TurnQueue()
        self.episodes = [Episode() for _ in range(episodes)]
        self.env_log: list[tuple[int, tuple[int, ...]]] = []  # (episode, turn it received)
        self.rng = np.random.default_rng(env_seed)
        self.gate, self.waiting, self.finished = gate, [], 0
        self.second_turns_sent = 0
        self.delivered: dict[int, int] = {}  # request id -> times on_turn got it
        self.errors: list[BaseException] = []
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        for i in range(len(self.episodes)):
            self._request(i, list(PROMPT), first=True)

    def _request(self, episode: int, prompt: list[int], first: bool) -> None:
        self.queue.put(self._turn(episode, prompt, first))

    def _turn(self, episode: int, prompt: list[int], first: bool) -> TurnRequest:
        self.episodes[episode].prompts.append(prompt)
        return TurnRequest(
            request_id=2 * episode + (0 if first else 1),
            prompt_ids=prompt,
            max_new_tokens=TURN_TOKENS,
            stop_ids=frozenset({NO_EOS}),
            draft_key="task",
            group=0,
            first_turn=first,
        )

    def on_turn(self, result: TurnResult) -> None:
        self.delivered[result.request_id] = self.delivered.get(result.request_id, 0) + 1
        episode, second = divmod(result.request_id, 2)
        self.episodes[episode].turns.append(result)
        if second:
            self.finished += 1
            stream, _, _ = self.episodes[episode].stream()
            self.queue.put(EpisodeDone("task", [*PROMPT, *stream]))
            if self.finished == len(self.episodes):
                self.queue.close()
        elif self.gate is None:
            self.queue.put(self._env_step(episode))
            self.second_turns_sent += 1
        else:
            self.waiting.append(episode)
            if len(self.waiting) == len(self.episodes):
                self.thread = threading.Thread(target=self._after_gate, daemon=True)
                self.thread.start()

    def _env_step(self, episode: int) -> TurnRequest:
        """The environment's answer to the episode's first turn; returns the second turn."""
        ep = self.episodes[episode]
        turn = tuple(ep.turns[0].token_ids.tolist())
        self.env_log.append((episode, turn))
        bit = int(self.rng.random() < P_REWARD)
        if self.coupled:
            bit = self.shared_bits.setdefault(episode // 2, bit)
        ep.obs = observation(turn, bit)
        return self._turn(episode, [*ep.prompts[0], *turn, *ep.obs], first=False)

    def _after_gate(self) -> None:
        assert self.gate is not None
        try:
            if not self.gate.wait(timeout=60):
                raise TimeoutError("the weights never came: the environments never stepped")
            # All at once: the second turns join the batch together.
            self.queue.put_many([self._env_step(episode) for episode in self.waiting])
            self.second_turns_sent = len(self.waiting)
        except BaseException as e:  # noqa: BLE001 - reported by run(), not lost on a thread
            self.errors.append(e)
            self.queue.close()

    def all_first_turns_done(self) -> bool:
        return len(self.waiting) == len(self.episodes)

    def all_second_turns_sent(self) -> bool:
        return self.second_turns_sent == len(self.episodes)


class SwapWhen:
    """A weight source that delivers ``new`` as version 1 at its first poll once ``ready()`` is
    true, then sets ``delivered``."""

    def __init__(self, new: Transformer, ready: Callable[[], bool]) -> None:
        self.state, self.ready = new.state_dict(), ready
        self.delivered = threading.Event()
        self.polls = 0

    def __call__(self) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        self.polls += 1
        if self.delivered.is_set() or not self.ready():
            return None
        self.delivered.set()
        return 1, self.state


def presize(engine: TorchEngine, rows: int, slots: int = 16) -> None:
    """Grow the engine's KV pool to ``rows`` rows of ``slots`` slots at once: admitting many
    rows into an empty pool grows it a few blocks per row, each growth a copy of the pool
    (quadratic in the rows; seconds at the thousands of rows of these checks)."""
    placeholder = -1  # no row of the engine has a negative id
    engine.cache.reserve(placeholder, rows * slots)
    engine.cache.release(placeholder)


def run(engine: TorchEngine, driver: Driver, source: SwapWhen | None) -> list[Episode]:
    """``serve`` the driver's episodes to the end; every request delivered exactly once."""
    presize(engine, len(driver.episodes))
    driver.start()
    engine.serve(driver.queue, source, driver.on_turn)
    if driver.thread is not None:
        driver.thread.join()
    if driver.errors:
        raise driver.errors[0]
    assert len(driver.delivered) == 2 * len(driver.episodes)
    assert set(driver.delivered.values()) == {1}, "a turn was delivered twice"
    return driver.episodes


WHEN = ("turn1", "turn2", "between")
"""Where the weights change in :func:`serve_episodes`: after turn 1's first step, after turn 2's
first step, or while every episode waits on its environment between the turns."""


class StaleHistoryEngine(TorchEngine):
    """Control, never a mode of the engine: a turn admitted after a weight change gets its
    history's KV computed under ``stale`` (the weights it was sampled under), as an engine that
    kept each episode's KV across the version change would; only the turn's new tokens are
    computed under the new weights. :func:`serve_episodes` with ``when="between"`` must tell it
    from the exact law."""

    def __init__(self, stale: Transformer, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stale = stale

    def _admit(self, call) -> None:
        before = {row.id for row in call.active}
        super()._admit(call)
        late = [
            row
            for row in call.active
            if row.id not in before and row.prefix and row.share[0] == "turn" and self.version
        ]
        if late:
            current = self.policy.model
            self.policy.model = self.stale
            try:
                self.decoder.prefill(late, [row.prefix for row in late])
            finally:
                self.policy.model = current
            for row in late:
                row.prefix = []


def serve_episodes(
    mode: str,
    when: str,
    episodes: int,
    seed: int = 0,
    stale_history: bool = False,
    spec: SpecConfig | None = None,
    coupled: bool = False,
) -> tuple[TorchEngine, Driver, list[Episode], tuple[Transformer, Transformer]]:
    """``episodes`` two-turn episodes with ``inflight=mode`` and the weights changing ``when``
    (:data:`WHEN`, or ``never``); ``stale_history``: the :class:`StaleHistoryEngine` control;
    ``spec``: the engine's drafting; ``coupled``: the :class:`Driver`'s coupled-siblings
    control. Returns the engine, the driver, the episodes and the (old, new) models."""
    if when not in (*WHEN, "never"):
        raise ValueError(f"when={when!r}: expected one of {WHEN} or never")
    old, new = model_pair()
    kwargs = dict(temperature=1.0, seed=seed, version=0, inflight=mode, spec=spec)
    if stale_history:
        engine: TorchEngine = StaleHistoryEngine(old_copy(old), old, NO_EOS, 0, **kwargs)
    else:
        engine = TorchEngine(old, NO_EOS, 0, **kwargs)
    driver: Driver
    if when == "never":
        driver = Driver(episodes, env_seed=seed + 1, coupled=coupled)
        return engine, driver, run(engine, driver, None), (old, new)
    ready = {
        "turn1": lambda: True,
        "turn2": lambda: driver.all_second_turns_sent(),
        "between": lambda: driver.all_first_turns_done(),
    }[when]
    source = SwapWhen(new, ready)
    gate = source.delivered if when == "between" else None
    driver = Driver(episodes, env_seed=seed + 1, gate=gate, coupled=coupled)
    out = run(engine, driver, source)
    if not source.delivered.is_set():
        raise RuntimeError("the weights never changed: the check would prove nothing")
    return engine, driver, out, (old, new)


def old_copy(model: Transformer) -> Transformer:
    """A frozen copy of ``model`` (the engine's own is overwritten by the swap)."""
    return copy.deepcopy(model).eval()


def env_saw_rejected(driver: Driver, episodes: Sequence[Episode]) -> int:
    """Turns the environment received that differ from the episode's final first turn."""
    return sum(
        received != tuple(episodes[index].turns[0].token_ids.tolist())
        for index, received in driver.env_log
    )


def episodes_pvalue(exact: Mapping[tuple[int, ...], float], episodes: Sequence[Episode]) -> float:
    """Chi-square p-value of the episodes' outcomes against ``exact``."""
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys), dtype=torch.float64)
    for ep in episodes:
        counts[index[ep.outcome()]] += 1
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64).exp()
    return chi_square_pvalue(counts, probs)


def logprob_errors(models: Mapping[int, Transformer], episodes: Sequence[Episode]) -> float:
    """The largest difference between a recorded behaviour log-prob and a fresh forward, over
    the turn's whole history, of the weights of the version that token was recorded with."""
    worst = 0.0
    for ep in episodes:
        for prompt, turn in zip(ep.prompts, ep.turns, strict=True):
            seq = torch.tensor([[*prompt, *turn.token_ids.tolist()]])
            for i, version in enumerate(turn.token_versions.tolist()):
                with torch.no_grad():
                    logits = models[version](seq)[:, :-1]
                lp = token_logprobs(logits, seq[:, 1:], 1.0)[0, len(prompt) - 1 + i]
                worst = max(worst, abs(float(lp) - float(turn.behaviour_logprobs[i])))
    return worst
