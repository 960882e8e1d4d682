"""The turn loop of multi-turn episodes, in the actor: token in, token out.

One batch: ``prompts_per_batch`` problems x ``group_size`` siblings, each sibling its own
environment session (never shared: siblings stay independent given the problem's seed). The
runner resets every session, renders the first prompt (the G siblings of a problem must get the
same one, else the group is refused), and feeds one :class:`~actors.engines.turns.TurnRequest`
per model turn to the engine's ``serve``, whose prompt is the episode's whole history. A finished
turn comes back on the decode thread and is handed to a thread of the runner's pool at once (the
decode loop never waits on an environment: other episodes keep decoding). There the turn's text
goes to the environment, and its answer is bridged into tokens (``common/chat_bridge.py``) and
appended as environment tokens (version -1, log-prob 0) before the next turn is requested.

Sampled tokens are never re-tokenised: the next prompt is the previous ids + the sampled ids +
the bridge's ids. The environment only ever sees a turn once the engine delivered it final (after
any delayed verification), so it never sees a token that is later rejected.

When the G episodes of a problem have ended, their group (protocol v2 completions:
``turn_starts``, ``turn_rewards``, ``stop``) goes to ``submit``. An episode ends on a model token:
glue or an observation after its last turn is not kept. Environments run in threads of the
actor's process (``env.workers=0``: trusted environments, such as the built-ins) or in worker
processes (``env.workers > 0``, ``actors/episodes/pool.py``, optionally sandboxed), which keep
their own deadlines and replace a worker that crashed or hung.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engines.turns import EpisodeDone, TurnQueue, TurnRequest, TurnResult
from actors.episodes.env import CheckedEnv, EnvFailure
from common import metric_names as mn
from common.chat_bridge import (
    BridgeError,
    CharBridge,
    ChatBridge,
    ObservationError,
    as_messages,
    cut_turn_glue,
    make_bridge,
    probe_conversation,
    uncapped,
)
from common.config.env import OPENENV_PREFIX, EnvConfig
from common.link.protocol import Completion, TrajectoryGroup
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CALL_THREADS = 64
"""Threads that run in-process environments' calls (``env.workers=0``)."""
FINISHED = ("eos", "env_done")
"""Stops of an episode that ended by itself (``Completion.finished``)."""


@dataclass
class Episode:
    """One sibling's episode as it grows."""

    problem: int
    sibling: int
    env: CheckedEnv
    prompt_ids: list[int] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    """The text of each turn the environment was given (what the tests compare)."""
    stop: str = ""
    waiting: bool = False
    """A turn of this episode is with the engine (requested, not yet delivered)."""
    failure: str = ""
    """The environment's failure kind (``EnvFailure.kind``), if it failed."""
    step_s: list[float] = field(default_factory=list)
    """Wall time of each ``step`` call, until its answer or its failure (a timeout included)."""
    messages: list[dict] = field(default_factory=list)
    """``env.check_bridge=always``: the conversation as chat messages (observations, and each
    model turn's text, stripped), probed against the template's full render when the episode
    ends."""

    def add_turn(self, result: TurnResult) -> None:
        self.turn_starts.append(len(self.stream))
        self.stream += result.token_ids.tolist()
        self.logprobs += result.behaviour_logprobs.tolist()
        self.versions += result.token_versions.tolist()
        self.turn_rewards.append(0.0)

    def add_env(self, ids: list[int]) -> None:
        self.stream += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def completion(self, reward: float) -> Completion:
        """The v2 completion: trailing environment tokens (glue after a cut last turn) dropped."""
        end = len(self.versions)
        while end and self.versions[end - 1] < 0:
            end -= 1
        return Completion(
            token_ids=np.asarray(self.stream[:end], dtype=np.int32),
            behaviour_logprobs=np.asarray(self.logprobs[:end], dtype=np.float32),
            token_versions=np.asarray(self.versions[:end], dtype=np.int32),
            reward=reward,
            finished=self.stop in FINISHED,
            turn_starts=np.asarray(self.turn_starts, dtype=np.int32),
            turn_rewards=np.asarray(self.turn_rewards, dtype=np.float32),
            stop=self.stop,
        )


class EpisodeRunner:
    """Runs the episodes of one batch through ``engine.serve`` (module docstring)."""

    def __init__(
        self,
        engine: Any,
        cfg: EnvConfig,
        bridge: ChatBridge | CharBridge,
        tokenizer: Tokenizer,
        make_env: Callable[[], CheckedEnv],
        stop_ids: frozenset[int],
    ) -> None:
        self.engine, self.cfg, self.bridge, self.tokenizer = engine, cfg, bridge, tokenizer
        self.make_env, self.stop_ids = make_env, stop_ids
        self.counts: Counter[str] = Counter()
        self.gauges: dict[str, float] = {}
        """The last batch's ``env/decode_idle_frac`` and ``env/step_s`` (mean step seconds)."""
        self._step_s: list[float] = []
        self._lock = threading.Lock()
        self._siblings = 1
        self._options: dict[str, Any] = {}
        self._probing = cfg.check_bridge == "always" and isinstance(bridge, ChatBridge)
        self._uncapped = uncapped(bridge) if self._probing else None
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="env-call")
        """In-process environments' calls (each waited for with its deadline, from the runner's
        threads); a hung call keeps its thread."""
        self.env_pool: Any = None
        """The environment's worker processes (``env.workers > 0``, :func:`episode_runner`),
        closed when the actor stops."""

    def run_batch(
        self,
        seeds: list[int],
        group_size: int,
        weight_source: Callable[[], Any] | None,
        submit: Callable[[TrajectoryGroup], None],
        options: dict[str, Any] | None = None,
        in_flight: int = 0,
    ) -> list[list[Episode]]:
        """Episodes of ``group_size`` siblings per seed; each problem's group goes to ``submit``
        once its episodes end (from a thread of the runner's pool). ``options``: added to every
        ``reset``'s (an evaluation's ``{"split": "eval"}``). ``in_flight``: problems whose
        episodes run at once (0: all); the next seed's episodes start as an earlier problem's
        group ends, in the same ``serve`` (continuous admission). Returns the episodes, a list
        per seed."""
        self._siblings = group_size
        self._options = dict(options or {})
        batch = _Batch(self, seeds, group_size, submit, in_flight or len(seeds))
        started = time.perf_counter()
        try:
            batch.admit_first()
            self.engine.serve(batch.queue, weight_source, batch.on_turn)
        finally:
            batch.leave()
            self._gauge(batch.queue.waited_s, time.perf_counter() - started)
        if batch.errors:
            raise batch.errors[0]
        return batch.episodes

    # ------------------------------------------------------------------ one episode's steps

    def _call(self, ep: Episode, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()`` (an environment call) within ``timeout_s``; EnvFailure on a failure. A
        session of worker processes keeps its own deadlines (``enforces_deadlines``); an
        in-process environment's call runs on a thread of its own, left behind if it hangs."""
        if getattr(ep.env, "enforces_deadlines", False):
            return fn()
        try:
            return self._calls.submit(fn).result(timeout=timeout_s)
        except FutureTimeout as err:  # the call's thread is left behind: in-process, trusted
            raise EnvFailure("timeout", f"no answer in {timeout_s:g} s") from err

    def _start(self, row: list[Episode], seed: int, queue: TurnQueue, finish) -> None:
        """Reset each sibling's environment; refuse the group if their first prompts differ."""
        prompts = []
        for ep in row:
            try:
                obs, _ = self._call(
                    ep,
                    lambda ep=ep: ep.env.reset(
                        seed=seed, options={**self._options, "sibling": ep.sibling}
                    ),
                    self.cfg.reset_timeout_s,
                )
                bridged = self.bridge.first_prompt_ids(obs)
            except (EnvFailure, ObservationError) as err:
                self._failed(ep, err)
                prompts.append(None)
                continue
            ep.prompt_ids = bridged.ids
            if self._probing:
                ep.messages = as_messages(obs, "user")
            prompts.append(tuple(bridged.ids))
        if len(set(prompts)) != 1 or prompts[0] is None:
            if None not in prompts:
                self._count(mn.ENV_RESET_MISMATCH)
                log.warning("siblings' first observations differ (seed %d): group refused", seed)
            for ep in row:
                ep.failure = ep.failure or "invalid"
                finish(ep, "env_error")
            return
        for ep in row:
            self._request(ep, queue, first=True, finish=finish)

    def _request(self, ep: Episode, queue: TurnQueue, first: bool, finish) -> None:
        """The next turn, if the episode's budget has room for one token."""
        used = len(ep.prompt_ids) + len(ep.stream)
        room = self.cfg.max_total_tokens - used
        if room < 1:
            finish(ep, "context")
            return
        ep.waiting = True
        queue.put(
            TurnRequest(
                request_id=ep.problem * self._siblings + ep.sibling,
                prompt_ids=[*ep.prompt_ids, *ep.stream],
                max_new_tokens=min(self.cfg.max_turn_tokens, room),
                stop_ids=self.stop_ids,
                draft_key=str(ep.problem),
                group=ep.problem,
                first_turn=first,
            )
        )

    def _after_turn(self, ep: Episode, result: TurnResult, queue: TurnQueue, finish) -> None:
        """Give the finished turn to the environment; bridge its answer; request the next turn."""
        with self._lock:
            outstanding, ep.waiting = ep.waiting, False
        if not outstanding:  # an engine bug: never let it end an episode twice
            raise RuntimeError(
                f"turn result {result.request_id} came with no turn of its episode outstanding"
            )
        ep.add_turn(result)
        tokens = result.token_ids.tolist()
        cut = result.stop == "length"
        if cut:
            glue = cut_turn_glue(self.bridge, self.cfg.turn_length)
            if glue is None:
                finish(ep, "length")
                return
        text = self.tokenizer.decode([t for t in tokens if t not in self.stop_ids])
        ep.seen.append(text)
        stepped = time.perf_counter()
        try:
            step = self._call(ep, lambda: ep.env.step(text), self.cfg.step_timeout_s)
        except EnvFailure as err:
            ep.step_s.append(time.perf_counter() - stepped)
            self._failed(ep, err)
            finish(ep, "env_timeout" if err.kind == "timeout" else "env_error")
            return
        ep.step_s.append(time.perf_counter() - stepped)
        with self._lock:
            self._step_s.append(ep.step_s[-1])
        ep.turn_rewards[-1] = step.reward
        if step.info.get("malformed"):
            self._count(mn.ENV_MALFORMED_ACTIONS)
        ended_by_model = bool(tokens) and tokens[-1] == self.tokenizer.eos_id
        if step.terminated:
            finish(ep, "env_done")
            return
        if ended_by_model and self.tokenizer.eos_id not in self.bridge.eot_ids:
            finish(ep, "eos")
            return
        if step.truncated or len(ep.turn_starts) >= self.cfg.max_turns:
            finish(ep, "max_turns")
            return
        try:
            bridged = self.bridge.bridge_ids(step.obs)
        except ObservationError as err:
            self._failed(ep, EnvFailure("invalid", str(err)))
            finish(ep, "env_error")
            return
        if bridged.truncated:
            self._count(mn.ENV_OBS_TRUNCATED)
        ep.add_env([*(glue if cut else []), *bridged.ids])
        if self._probing:
            # The reply stripped: whitespace at its edges tokenises with its neighbours in a
            # full render, a difference of the reply's tokens, not of the template.
            ep.messages += [
                {"role": "assistant", "content": text.strip() or "ok"},
                *as_messages(step.obs, self.cfg.obs_role),
            ]
        self._request(ep, queue, first=False, finish=finish)

    # ------------------------------------------------------------------ groups and counters

    def _probe(self, ep: Episode) -> None:
        """``env.check_bridge=always``: the episode's conversation (its texts) rendered whole
        against the bridge turn by turn; a difference is counted and logged, the episode kept
        (its tokens are what was sampled and bridged either way)."""
        if not self._probing or not any(m["role"] == "assistant" for m in ep.messages):
            return
        try:
            probe_conversation(self._uncapped, ep.messages, f"episode {ep.problem}.{ep.sibling}")
        except BridgeError as err:
            self._count(mn.ENV_BRIDGE_MISMATCHES)
            log.warning("env.check_bridge=always: %s", err)

    def _gauge(self, idle_s: float, wall_s: float) -> None:
        """The batch's share of ``serve`` with no row to decode, and its mean step time."""
        with self._lock:
            steps, self._step_s = self._step_s, []
        self.gauges[mn.ENV_DECODE_IDLE_FRAC] = idle_s / wall_s if wall_s > 0 else 0.0
        self.gauges[mn.ENV_STEP_S] = sum(steps) / len(steps) if steps else 0.0

    def _close(self, ep: Episode) -> None:
        """Close the episode's environment; a failure to close (an environment whose call is
        still hung in its thread, one that raises in ``close``) is logged, never raised."""
        if ep.failure == "timeout":
            return  # its call still runs in the thread it was left to: closing would race it
        try:
            ep.env.close()
        except Exception as err:  # noqa: BLE001 - the user's environment
            log.warning("closing the environment of episode %d.%d: %r", ep.problem, ep.sibling, err)

    def _failed(self, ep: Episode, err: EnvFailure | ObservationError) -> None:
        kind = err.kind if isinstance(err, EnvFailure) else "invalid"
        ep.failure = kind
        self._count(f"{mn.ENV_FAILURES_PREFIX}{kind}")
        log.warning("environment of episode %d.%d failed: %s", ep.problem, ep.sibling, err)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def _send(self, row: list[Episode], seed: int, submit) -> None:
        """The group of one problem, when its episodes ended (dropped per ``env.on_failure``)."""
        failed = any(ep.failure for ep in row)
        if failed and self.cfg.on_failure == "drop_group":
            self._count(mn.ENV_GROUPS_DROPPED)
            return
        if any(not ep.stream for ep in row):  # a failure before the first turn: nothing to train
            self._count(mn.ENV_GROUPS_DROPPED)
            return
        completions = [
            ep.completion(self.cfg.failure_reward if ep.failure else sum(ep.turn_rewards))
            for ep in row
        ]
        for ep in row:
            self._count(f"{mn.ENV_STOP_PREFIX}{ep.stop}")
        sampled = [
            int(v.min()) for c in completions if (v := c.token_versions[c.token_versions >= 0]).size
        ]
        tokens = sum(len(c.token_ids) for c in completions)
        env_tokens = sum(int((c.token_versions < 0).sum()) for c in completions)
        submit(
            TrajectoryGroup(
                actor_id="",
                seq=0,
                prompt_id=f"env-{seed}",
                prompt_ids=np.asarray(row[0].prompt_ids, dtype=np.int32),
                version=min(sampled) if sampled else 0,
                completions=completions,
                stats={
                    mn.ENV_TURNS_MEAN: float(np.mean([len(ep.turn_starts) for ep in row])),
                    mn.ENV_TOKEN_FRAC: env_tokens / max(tokens, 1),
                },
            )
        )


class _Batch:
    """One ``run_batch`` call's state: the episodes admitted so far (a row per seed), the
    groups left, the turn queue ``serve`` reads and the threads that step the environments."""

    def __init__(
        self,
        runner: EpisodeRunner,
        seeds: list[int],
        group_size: int,
        submit: Callable[[TrajectoryGroup], None],
        in_flight: int,
    ) -> None:
        self.runner, self.seeds, self.group_size, self.submit = runner, seeds, group_size, submit
        self.in_flight = max(1, min(in_flight, len(seeds)))
        self.episodes: list[list[Episode]] = []
        self.by_id: dict[int, Episode] = {}
        self.left: dict[int, int] = {}
        self.queue, self.errors, self.over = TurnQueue(), [], threading.Event()
        self.unfinished = len(seeds) * group_size
        self.lock = threading.Lock()
        threads = max(1, min(32, self.in_flight * group_size))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="env")

    def admit_first(self) -> None:
        for _ in range(self.in_flight):
            self._admit()

    def _admit(self) -> None:
        """The next seed's episodes, their environments reset on a thread of the pool."""
        with self.lock:
            p = len(self.episodes)
            if p >= len(self.seeds) or self.over.is_set():
                return
            row = [Episode(p, g, self.runner.make_env()) for g in range(self.group_size)]
            self.episodes.append(row)
            self.left[p] = self.group_size
            for ep in row:
                self.by_id[p * self.group_size + ep.sibling] = ep
        self.pool.submit(
            self.guarded, self.runner._start, row, self.seeds[p], self.queue, self.finish
        )

    def finish(self, ep: Episode, stop: str) -> None:
        """``ep`` ended: its end to the engine, its group sent once complete (and the next seed
        admitted), the queue closed after the batch's last episode."""
        ep.stop = ep.stop or stop
        self.runner._probe(ep)
        with self.lock:
            self.left[ep.problem] -= 1
            self.unfinished -= 1
            done, closing = self.left[ep.problem] == 0, self.unfinished == 0
        self.queue.put(EpisodeDone(str(ep.problem), [*ep.prompt_ids, *ep.stream]))
        if done:
            self.runner._send(self.episodes[ep.problem], self.seeds[ep.problem], self.submit)
            self._admit()
        if closing:
            self.queue.close()

    def guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:  # a bug here, not the environment's: stop the batch
            if self.over.is_set():
                return  # the batch was left (a stop): what its episodes did no longer counts
            log.exception("episode runner: %s", err)
            self.errors.append(err)
            self.queue.close()

    def on_turn(self, result: TurnResult) -> None:
        """A turn the engine delivered (on the decode thread): handed to the pool at once."""
        ep = self.by_id[result.request_id]
        self.pool.submit(self.guarded, self.runner._after_turn, ep, result, self.queue, self.finish)

    def leave(self) -> None:
        """``serve`` returned (done, stopped or failed): no more admissions; environments
        closed."""
        self.over.set()
        self.queue.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            admitted = list(self.by_id.values())
        for ep in admitted:
            self.runner._close(ep)


def probe_server(env: CheckedEnv, spec: str) -> None:
    """One session with an OpenEnv server at start (reset, seed 0): EnvSpecError, with the
    reason, where it cannot be had."""
    from actors.episodes.env import EnvSpecError

    try:
        env.reset(seed=0, options={"probe": True})
    except EnvFailure as err:
        raise EnvSpecError(f"env.name={spec}: no session with the OpenEnv server: {err}") from err


def episode_runner(cfg: Any, engine: Any, tokenizer: Tokenizer) -> EpisodeRunner:
    """The runner of ``cfg.env`` on ``engine`` (the torch engine's ``serve``): the chat bridge
    of ``tokenizer`` (probed against full re-renders unless ``env.check_bridge=off``), a fresh
    environment per episode, turns ending at EOS or the template's end of turn."""
    from actors.episodes.env import make_env

    env = cfg.env  # engine=torch: the config refuses an environment on another engine
    bridge = make_bridge(
        tokenizer,
        obs_role=env.obs_role,
        max_obs_chars=env.max_obs_chars,
        max_obs_tokens=env.max_obs_tokens,
        system_prompt=cfg.task.system_prompt,
        check=env.check_bridge != "off",
    )
    stop_ids = frozenset({tokenizer.eos_id, *bridge.eot_ids})
    bound = cfg.learner.max_abs_reward

    if env.workers > 0:  # sessions on worker processes; a worker that cannot start stops here
        from actors.episodes.pool import EnvPool

        pool = EnvPool(
            env.name,
            env.kwargs,
            workers=env.workers,
            max_abs_reward=bound,
            reset_timeout_s=env.reset_timeout_s,
            step_timeout_s=env.step_timeout_s,
            sandbox=env.sandbox,
        )
        try:
            runner = EpisodeRunner(engine, env, bridge, tokenizer, pool.session, stop_ids)
        except BaseException:
            pool.close()
            raise
        runner.env_pool = pool
        return runner

    openenv = env.name.startswith(OPENENV_PREFIX)
    kwargs = dict(env.kwargs)
    if openenv:  # the session keeps the run's deadlines itself (unless env.kwargs sets them)
        deadlines = {"reset_timeout_s": env.reset_timeout_s, "step_timeout_s": env.step_timeout_s}
        kwargs = {**deadlines, **kwargs}

    def fresh() -> CheckedEnv:
        return make_env(env.name, kwargs, bound)

    probe = fresh()  # a spec that cannot build an environment stops the actor here
    try:
        if openenv:  # and a server that does not answer
            probe_server(probe, env.name)
    finally:
        probe.close()
    return EpisodeRunner(engine, env, bridge, tokenizer, fresh, stop_ids)
