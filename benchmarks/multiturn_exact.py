"""The exactness rows of ``benchmarks/multiturn.py`` (design note §5.1, §5.2).

Two-turn episodes of the vocabulary-4 model pair through the torch engine's turn-request stream
(``testing/multiturn_check.py``): turn 1, a token-dependent stochastic environment, turn 2, with
the weights changing after turn 2's first step (``midturn``), while every episode waits on its
environment (``between``) or after turn 1's first step (``turn1``). Each figure is the chi-square
p-value of the episodes against the exact law of where the weights changed; the two controls
(``keep`` mid-turn, and history KV computed under the old weights and kept across the change)
must fail it. The same runs give the recorded log-probs' largest error against fresh forwards of
each token's own version over the whole history, and the turns the environment received that
verification later rejected.
"""

from __future__ import annotations

from common import metric_names as mn
from testing import multiturn_check as mc

EPISODES = 6000
"""Episodes per chi-square row: the controls fail at p < 1e-10 with these counts."""
LOGPROB_EPISODES = 200
"""Episodes whose every recorded log-prob is recomputed (a forward per token)."""


def pvalue(mode: str, when: str, law: tuple[int, int], episodes: int, **kwargs) -> float:
    """The p-value of ``episodes`` episodes (``mode``, weights changing ``when``) against the
    law whose turn 1 and turn 2 follow models ``law`` (0 old, 1 new)."""
    _, _, out, models = mc.serve_episodes(mode, when, episodes, **kwargs)
    exact = mc.exact_episode_logprobs(models[law[0]], models[law[1]])
    return mc.episodes_pvalue(exact, out)


def figures(episodes: int = EPISODES) -> dict:
    """The exactness rows (module docstring), each goal as a ``target_*`` key beside it."""
    old_new, new_new = (0, 1), (1, 1)
    out: dict = {"mt_exact_episodes_per_row": episodes}
    rows = {
        "mt_exact_p_verify_on_swap_midturn": ("verify_on_swap", "turn2", old_new, {}),
        "mt_exact_p_verify_on_finish_midturn": ("verify_on_finish", "turn2", old_new, {}),
        "mt_exact_p_abort_midturn": ("abort", "turn2", old_new, {}),
        "mt_exact_p_swap_between_turns": ("verify_on_swap", "between", old_new, {}),
        "mt_exact_p_swap_in_turn1": ("verify_on_swap", "turn1", new_new, {}),
        "mt_control_p_keep_midturn": ("keep", "turn2", old_new, {}),
        "mt_control_p_stale_history_kv": (
            "verify_on_swap",
            "between",
            old_new,
            {"stale_history": True},
        ),
    }
    for key, (mode, when, law, kwargs) in rows.items():
        out[key] = pvalue(mode, when, law, episodes, **kwargs)
        control = key.startswith("mt_control")
        out[f"target_{key}"] = "< 0.01 (the control must fail)" if control else ">= 0.01"
        print(f"  {key}: {out[key]:.3g}", flush=True)
    worst = 0.0
    for mode in ("verify_on_swap", "verify_on_finish", "abort"):
        _, _, eps, models = mc.serve_episodes(mode, "turn2", LOGPROB_EPISODES)
        worst = max(worst, mc.logprob_errors(dict(enumerate(models)), eps))
    out["mt_recorded_logprob_max_err"] = worst
    out["target_mt_recorded_logprob_max_err"] = "<= 1e-4"
    # verify_on_finish with the swap in turn 1: turns are cut and decoded on before delivery.
    engine, driver, eps, _ = mc.serve_episodes("verify_on_finish", "turn1", 400)
    out["mt_env_saw_rejected_token"] = mc.env_saw_rejected(driver, eps)
    out["mt_env_saw_rejected_token_wasted_tokens"] = engine.stats()[mn.VERIFY_WASTED_TOKENS]
    out["target_mt_env_saw_rejected_token"] = "== 0 (with wasted tokens > 0)"
    return out
