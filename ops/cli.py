"""``specrl``: subcommands ``run`` (embedded default), ``init-model``, ``warm-draft``, ``learner``,
``actor``, ``keys``, ``report``, ``plan``, ``slurm``, ``export-draft``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common.entrypoint import OVERRIDES_HELP, parse

USAGE = f"""\
usage: specrl COMMAND [KEY=VALUE ...]

commands:
  run          start a private Redis, the learner and N actors; live progress; summary at the end
  init-model   build and warm-start the tiny built-in model of a task, or build a model preset
               (model=smollm2-135m); `run` does it when needed
  warm-draft [--prompts P --samples-per-prompt S --epochs N --out DIR ...]
               warm-start the model's draft adapter (spec.adapter) on its own samples of the
               task: held-out acceptance before/after; `specrl warm-draft -h` lists the flags
  export-draft SRC OUT [--force]
               write the EAGLE-3 head of a model or checkpoint directory as the draft model a
               stock vLLM loads (speculative method eagle3)
  learner      run the learner process only (same as specrl-learner)
  actor        run one actor process only (same as specrl-actor)
  keys DIR [--actor NAME ...]
               write CurveZMQ key pairs for security.curve_dir=DIR (learner + one per actor
               name, default "actor"), each actor's public key authorized in DIR/authorized/
  report DIR   write report.png and report.md of a run directory from its metrics.jsonl
  plan MODEL [--gpus N] [--precision P] [--max-tokens T] ...
               estimated memory per GPU of the learner and of an actor for an HF model
               directory (or config.json); `specrl plan -h` lists the settings
  slurm --run-name NAME --nodes N --gpus-per-node G --shared-dir DIR (--venv DIR | --image I)
               [--dry-run] write the sbatch script of a run on Slurm (Redis on node 0, the
               learner under torchrun, one actor per GPU); `specrl slurm -h` lists the options

{OVERRIDES_HELP}
examples:
  specrl run
  specrl run actor.num_actors=3 task=addition run.steps=200
  specrl warm-draft model=smollm2-135m task=word_problems
  specrl report runs/run-20250101-120000
  SPECRL_REDIS_PASSWORD=... specrl-actor learner.address=tcp://10.0.0.5:5555 \
      redis.url=redis://10.0.0.5:6379/0   (a password in redis.url would show in ps)
"""


def _run(rest: list[str]) -> int:
    from ops.launcher import PreflightError, run

    # A fresh run id per invocation unless one is given, so a second `specrl run` starts
    # over instead of resuming a finished run.
    if not any(a.startswith("run.name=") for a in rest) and not _asks_help(rest):
        rest = [*rest, f"run.name=run-{time.strftime('%Y%m%d-%H%M%S')}"]
    cfg = parse(rest, "specrl run", "Runs the whole pipeline on this machine.")
    if cfg is None:
        return 0
    try:
        summary = run(cfg, rest)
    except PreflightError as e:
        print(f"specrl run: {e}", file=sys.stderr)
        return 2
    return 0 if summary.get("outcome") == "completed" else 1


def _init_model(rest: list[str]) -> int:
    from learner.prepare.warm_start import default_model_dir, warm_start

    cfg = parse(
        rest,
        "specrl init-model",
        "Builds and warm-starts the tiny built-in model, or builds a model preset "
        "(model=smollm2-135m).",
    )
    if cfg is None:
        return 0
    if cfg.model.preset:
        from learner.prepare.presets import PresetError, ensure_preset

        try:
            path = ensure_preset(cfg.model.preset, Path(cfg.model.path))
        except PresetError as e:
            print(f"specrl init-model: {e}", file=sys.stderr)
            return 2
        print(f"model written to {path}")
        return 0
    out = Path(cfg.model.path) if cfg.model.path else default_model_dir(cfg)
    summary = warm_start(cfg, out)
    print(f"model written to {out}")
    for key, value in summary.items():
        print(f"  {key:<24} {value:.4g}")
    return 0


WARM_DRAFT_HELP = """\
Warm-starts the draft adapter (spec.adapter) of the config's model before RL: samples the
model's own completions of the task's training prompts (bf16 copy, the run's sampling
settings), keeps the spec.adapter_vocab tokens they use most (0 = the whole vocabulary), trains
a fresh adapter after spec.exit_layer layers (default: a fifth of the layers) on them and
saves it into the model directory (draft/model.safetensors; model.safetensors is left as it is).
Prints, and writes as JSON, the held-out acceptance before and after and the expected tokens
per verification at spec.k. Overrides are the run's: model=, task=, sampling.*,
spec.exit_layer, spec.adapter_vocab, spec.adapter_lr, spec.k, run.seed, run.torch_threads
(default 1: on a dedicated machine give it every core). With spec=eagle3 it warm-starts
the policy's EAGLE-3 head instead (spec.eagle_vocab, spec.eagle_lr; eagle/model.safetensors)."""


def _warm_draft_parser() -> argparse.ArgumentParser:
    from learner.prepare.draft_data import SAMPLERS, WARMUP_LR
    from learner.prepare.draft_data import WarmDraftOptions as O

    parser = argparse.ArgumentParser(
        prog="specrl warm-draft",
        usage="specrl warm-draft [--FLAG VALUE ...] [KEY=VALUE ...]",
        description=WARM_DRAFT_HELP,
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--prompts", type=int, default=O.prompts, help="training prompts, held-out ones included")
    add("--samples-per-prompt", type=int, default=O.samples_per_prompt)
    add("--epochs", type=int, default=O.epochs)
    add("--batch", type=int, default=O.batch, help="sequences per AdamW step")
    add("--holdout", type=float, default=O.holdout, help="share of prompts held out")
    add(
        "--lr",
        type=float,
        help=f"AdamW rate (default: spec.adapter_lr if given, else {WARMUP_LR:g})",
    )
    add("--sample-batch", type=int, default=O.sample_batch, help="prompts decoded together")
    add(
        "--sample-dtype",
        default=O.sample_dtype,
        choices=("bfloat16", "float32"),
        help="dtype of the sampling copy (float32: for a CPU without bf16 instructions)",
    )
    add(
        "--sampler",
        default=O.sampler,
        choices=SAMPLERS,
        help="who samples the completions: auto = vLLM for spec=eagle3 where it serves the model",
    )
    add("--device", default=O.device, help="auto (cuda when available), cpu, cuda, ...")
    add("--out", type=Path, help="write a copy of the model directory with the adapter here")
    add(
        "--summary",
        type=Path,
        help="JSON summary (default <model dir>/draft_warmup.json; eagle_warmup.json for eagle3)",
    )
    return parser


def _warm_draft(rest: list[str]) -> int:
    from learner.prepare.draft_data import WarmDraftError, WarmDraftOptions
    from learner.prepare.draft_warmup import warm_draft
    from learner.prepare.presets import PresetError

    parser = _warm_draft_parser()
    if _asks_help(rest):
        parser.print_help()
        return 0
    flags, overrides = parser.parse_known_args(rest)
    cfg = parse(overrides, "specrl warm-draft", parser.description or "")
    if cfg is None:
        return 0

    def explicit(key: str) -> object:
        """The config's value of ``spec.KEY`` when the command line sets it, else None."""
        given = any(a.lstrip("+").startswith(f"spec.{key}=") for a in overrides)
        return getattr(cfg.spec, key) if given else None

    eagle = cfg.spec.uses_eagle  # the EAGLE-3 head's own knobs, else the adapter's
    opts = WarmDraftOptions(
        **{k: v for k, v in vars(flags).items() if v is not None},
        exit_layer=None if eagle else explicit("exit_layer"),
        vocab=explicit("eagle_vocab" if eagle else "adapter_vocab"),
        command=["specrl", "warm-draft", *rest],
    )
    if opts.lr is None:
        opts.lr = explicit("eagle_lr" if eagle else "adapter_lr")
    try:
        _, summary = warm_draft(cfg, opts)
    except (WarmDraftError, PresetError, FileNotFoundError) as e:
        print(f"specrl warm-draft: {e}", file=sys.stderr)
        return 2
    print(f"{'EAGLE-3 head' if eagle else 'draft adapter'} written to {summary['model_dir']}")
    for key, value in summary.items():
        if key not in ("model_dir", "command"):
            print(f"  {key:<26} {value}")
    return 0


EXPORT_DRAFT_HELP = """\
Writes the policy's EAGLE-3 head (its eagle.* tensors) of SRC, a model or checkpoint directory
(or a safetensors file beside its config.json), to OUT as a draft model directory: config.json
in vLLM's EAGLE-3 form (LlamaForCausalLMEagle3, the target's shapes, the aux layer ids) and
model.safetensors. Serve it with vLLM next to the policy itself:
  vllm.LLM(model=SRC, speculative_config={"method": "eagle3", "model": OUT,
           "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"})"""


def _export_draft(rest: list[str]) -> int:
    from actors.engines.vllm.eagle import EagleHeadError, export_draft

    parser = argparse.ArgumentParser(
        prog="specrl export-draft",
        description=EXPORT_DRAFT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", type=Path, help="model or checkpoint directory with the head")
    parser.add_argument("out", type=Path, help="the draft model directory to write")
    parser.add_argument(
        "--force", action="store_true", help="replace OUT if it holds a previous export (only that)"
    )
    args = parser.parse_args(rest)
    try:
        out = export_draft(args.src, args.out, force=args.force)
    except (EagleHeadError, OSError, ValueError) as e:
        print(f"specrl export-draft: {e}", file=sys.stderr)
        return 2
    print(f"EAGLE-3 draft written to {out}")
    return 0


def _keys(rest: list[str]) -> int:
    from common.curve_keys import ACTOR
    from ops.keys import write_keys

    parser = argparse.ArgumentParser(prog="specrl keys", description="CurveZMQ key pairs.")
    parser.add_argument("dir", type=Path)
    parser.add_argument(
        "--actor",
        action="append",
        metavar="NAME",
        help="an actor key pair to create and authorize (repeatable; default: actor)",
    )
    args = parser.parse_args(rest)
    try:
        written = write_keys(args.dir, tuple(args.actor or [ACTOR]))
    except (ValueError, OSError, RuntimeError) as e:
        print(f"specrl keys: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    if not written:
        print(f"specrl keys: every requested key already exists in {args.dir}")
    return 0


def _report(rest: list[str]) -> int:
    if len(rest) != 1 or _asks_help(rest):
        print("usage: specrl report RUN_DIR", file=sys.stderr)
        return 0 if _asks_help(rest[:1]) else 2
    from ops.report import ReportError, write_report

    try:
        paths = write_report(Path(rest[0]))
    except ReportError as e:
        print(f"specrl report: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def _plan(rest: list[str]) -> int:
    from ops.memory_plan import main as plan_main

    return plan_main(rest)


def _slurm(rest: list[str]) -> int:
    from ops.slurm import main as slurm_main

    return slurm_main(rest)


def _process(module: str) -> Callable[[list[str]], int]:
    def execute(rest: list[str]) -> int:
        # exec, not import: the process is then exactly specrl-learner or specrl-actor (its own
        # argv and signal handlers, no operator modules loaded).
        os.execv(sys.executable, [sys.executable, "-m", module, *rest])

    return execute


def _asks_help(args: list[str]) -> bool:
    return "-h" in args or "--help" in args


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": _run,
    "init-model": _init_model,
    "warm-draft": _warm_draft,
    "export-draft": _export_draft,
    "keys": _keys,
    "report": _report,
    "plan": _plan,
    "slurm": _slurm,
    "learner": _process("learner.main"),
    "actor": _process("actors.main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"specrl: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
