"""The calibration gate of ``guess_number`` (common/guess_number.py, design notes §3.1): the
untrained SmolLM2 preset (``model=smollm2-135m``) plays ``--instances`` training-pool instances
through the real episode runner (``actors/episodes/runner.py``) on the torch engine, at the
preset's sampling settings.

    python -m benchmarks.guess_calibration [--json PATH] [--instances 100] [--samples 1]

The config is the one ``specrl run model=smollm2-135m task=guess_number env.name=guess_number
env.max_turn_tokens=24`` resolves (plus ``--set`` overrides), except that no draft runs
(``spec=none``: drafting is lossless, so the figures do not depend on it).

Figures: ``guess_parse_rate`` (turns holding an integer / turns; goal >= 0.8),
``guess_success_rate`` (episodes that found the secret; goal in [0.05, 0.6]), ``guess_gate_pass``,
``guess_no_feedback_ceiling`` (of the instances played, and ``..._pool`` / ``..._held_out`` of
the whole sets), ``guess_direction_consistency`` (pooled over turns), ``guess_in_range_rate``,
``guess_turns_mean``, ``guess_stops``, a few ``guess_examples``; ``commit``, ``dirty``,
``command`` (``benchmarks/cli.py``).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks import cli
from common import guess_number as gn

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = [
    "model=smollm2-135m",
    "task=guess_number",
    "env.name=guess_number",
    "env.max_turn_tokens=24",
    "spec=none",
]
PARSE_GOAL = 0.8
SUCCESS_GOAL = (0.05, 0.6)


def play(instances: int, samples: int, overrides: list[str], seed: int) -> list[list]:
    """The episodes (one row of ``samples`` siblings per seed 0..instances-1, i.e. per pool
    instance) of the untrained preset."""
    from actors.engines.torch.engine import TorchEngine
    from actors.episodes.runner import episode_runner
    from common.config import load_config
    from common.model import load_pretrained
    from common.model_presets import preset_dir
    from common.tokenizer import load_tokenizer
    from learner.prepare.presets import ensure_preset

    cfg = load_config([*OVERRIDES, *overrides])
    model_dir = ensure_preset(cfg.model.preset, ROOT / preset_dir(cfg.model.preset))
    torch.manual_seed(seed)
    model = load_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(
        model,
        tokenizer.eos_id,
        tokenizer.pad_id,
        cfg.sampling.temperature,
        cfg.sampling.top_p,
        seed=seed,
        version=0,
        spec=cfg.spec,
        max_rows=cfg.engine.max_rows or None,
    )
    runner = episode_runner(cfg, engine, tokenizer)
    return runner.run_batch(list(range(instances)), samples, None, lambda group: None)


def figures(episodes: list[list], instances: list[gn.Instance]) -> dict[str, object]:
    """What the gate reads, from the texts each environment was given."""
    turns = parsed = in_range = solved = 0
    consistent = eligible = 0
    stops: Counter[str] = Counter()
    examples = []
    for inst, row in zip(instances, episodes, strict=True):
        for ep in row:
            guesses = [gn.parse_guess(text) for text in ep.seen]
            kinds = [gn.answer(inst, g)[1] for g in guesses]
            turns += len(guesses)
            parsed += sum(g is not None for g in guesses)
            in_range += sum(k not in ("malformed", "out_of_range") for k in kinds)
            solved += "correct" in kinds
            c, e = gn.direction_consistency(inst.lo, inst.hi, guesses, kinds)
            consistent, eligible = consistent + c, eligible + e
            stops[ep.stop] += 1
            if len(examples) < 6:
                examples.append({"instance": list(inst), "turns": ep.seen, "feedback": kinds})
    count = sum(len(row) for row in episodes)
    parse, success = parsed / max(turns, 1), solved / max(count, 1)
    return {
        "guess_episodes": count,
        "guess_turns": turns,
        "guess_parse_rate": round(parse, 4),
        "target_guess_parse_rate": PARSE_GOAL,
        "guess_success_rate": round(success, 4),
        "target_guess_success_rate": list(SUCCESS_GOAL),
        "guess_gate_pass": parse >= PARSE_GOAL and SUCCESS_GOAL[0] <= success <= SUCCESS_GOAL[1],
        "guess_no_feedback_ceiling": round(gn.no_feedback_ceiling(instances), 4),
        "guess_no_feedback_ceiling_pool": round(gn.no_feedback_ceiling(gn.training_pool()), 4),
        "guess_no_feedback_ceiling_held_out": round(gn.no_feedback_ceiling(gn.held_out()), 4),
        "guess_direction_consistency": round(consistent / eligible, 4) if eligible else None,
        "guess_direction_eligible_turns": eligible,
        "guess_in_range_rate": round(in_range / max(turns, 1), 4),
        "guess_turns_mean": round(turns / max(count, 1), 3),
        "guess_stops": dict(stops),
        "guess_examples": examples,
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--instances", type=int, default=100, help="pool instances (seeds 0..N-1)")
    p.add_argument("--samples", type=int, default=1, help="episodes per instance (siblings)")
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    p.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    opts = p.parse_args(argv)
    started = time.perf_counter()
    instances = [gn.instance(s) for s in range(opts.instances)]
    episodes = play(opts.instances, opts.samples, opts.set, opts.seed)
    out = figures(episodes, instances)
    out["guess_overrides"] = [*OVERRIDES, *opts.set]
    for key in ("parse_rate", "success_rate", "no_feedback_ceiling", "direction_consistency"):
        print(f"{key}: {out[f'guess_{key}']}", flush=True)
    print(f"gate {'passes' if out['guess_gate_pass'] else 'FAILS'}", flush=True)
    return cli.finish(out, opts.json, started)


if __name__ == "__main__":
    raise SystemExit(main())
