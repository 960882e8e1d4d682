"""A Gemma 3 model directory through `specrl run` on engine=vllm: private Redis, the learner and a
vLLM actor as processes, the built-in task, n-gram drafts. The learner trains the transformers
model and publishes its versions, the actor takes them mid-run, the ledger accounts for every
group, and the final checkpoint opens in transformers as a Gemma 3 model. spec=early_exit on the
same directory is refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import metric_names as mn
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from ops.ledger import read_ledger
from ops.metrics_file import read_metrics
from ops.processes import ROOT
from testing.models import random_hf_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

STEPS = 4
SHORT = [
    f"run.steps={STEPS}",
    "run.ledger=true",
    "actor.num_actors=1",
    "actor.group_size=8",
    "actor.prompts_per_batch=2",
    "learner.groups_per_step=4",
    # Calls long enough that versions land inside them (a version published between calls is
    # loaded before the next one, no swap mid-rollout): a random model seldom stops early.
    "task.max_new_tokens=32",
    # A random model seldom reverses a string exactly; partial credit for the digits it gets
    # right gives completions of a group different rewards, hence a gradient.
    "task.partial_credit=0.5",
    "engine.vllm_max_model_len=64",
]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """A user's Gemma 3 directory: random weights, the built-in character tokenizer (the model's
    vocabulary is the tokenizer's, so every sampled id decodes)."""
    directory = tmp_path_factory.mktemp("gemma3")
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    random_hf_model("gemma3_text", tokenizer.vocab_size, seed=0).save_pretrained(directory)
    tokenizer.save(directory)
    return directory


def specrl_run(run_dir: Path, model_dir: Path, extra: list[str], timeout: float):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.cli",
            "run",
            f"run.name=foreign-{run_dir.name}",
            f"run.dir={run_dir}",
            f"model.path={model_dir}",
            "engine=vllm",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_gemma3_directory_trains_through_the_launcher_on_vllm(gemma_dir, tmp_path):
    run_dir = tmp_path / "run"
    done = specrl_run(run_dir, gemma_dir, ["spec=ngram", *SHORT], timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed", summary
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS, summary

    # The learner took every step, with a gradient where rewards differed within a group.
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if mn.LEARNER_GRAD_NORM in r]
    assert [r[mn.LEARNER_VERSION] for r in steps] == list(range(1, STEPS + 1))
    assert any(r[mn.LEARNER_GRAD_NORM] > 0 for r in steps), steps

    # The vLLM actor served Gemma 3, drafted with n-grams, and took new versions mid-rollout.
    actor_log = (run_dir / "actor-0.log").read_text()
    assert "Gemma3ForCausalLM" in actor_log
    assert sum(r.get(mn.VERIFY_SWAPS, 0) for r in rows) >= 1, rows
    assert any(r.get(mn.SPEC_ACCEPTANCE_RATE, 0) > 0 for r in rows)

    # Nothing lost or duplicated, and groups sampled after version 0 were trained.
    ledger = read_ledger(run_dir)
    assert ledger.trained
    assert not ledger.lost() and not ledger.duplicated() and not ledger.unknown()
    assert max(r["version"] for r in ledger.trained) >= 1, ledger.trained

    # The final checkpoint is a Gemma 3 model in transformers, with trained weights.
    import transformers

    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert ckpt.name == f"step_{STEPS:08d}"
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert isinstance(model, transformers.Gemma3ForCausalLM)
    assert model.config.model_type == "gemma3_text"
    before = load_file(str(gemma_dir / "model.safetensors"))
    after = model.state_dict()
    assert set(before) <= set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before), "weights did not change"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


def test_the_early_exit_on_a_gemma3_directory_is_refused_before_anything_starts(
    gemma_dir, tmp_path
):
    run_dir = tmp_path / "run"
    done = specrl_run(run_dir, gemma_dir, ["spec=early_exit", *SHORT], timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-4000:]
    assert f"model.path='{gemma_dir}'" in out
    assert "spec=early_exit drafts with the policy's own first layers" in out, out
    assert "model_type='gemma3_text'" in out and "use spec=ngram or spec=none" in out, out
    assert not run_dir.exists()  # no process started, nothing written
