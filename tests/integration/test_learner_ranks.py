"""The learner on 2 FSDP2 ranks (torchrun, gloo) through the real pipeline: training a
transformers Qwen2 model (an actor loads its published versions, a restart on 2 ranks resumes and
versions keep growing, and the checkpoint opens in transformers), and training the built-in
model's EAGLE-3 head (spec=eagle3), which an actor drafts with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from common import metric_names as mn
from common.eagle import attach_eagle
from common.model import load_pretrained
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.checkpoint import latest_checkpoint
from learner.checkpoint_sharded import export_checkpoint, is_sharded
from ops.processes import ROOT, Process
from testing.own_model import tiny_hf_config
from testing.pipeline import Pipeline, wait_exit, warm_model

pytestmark = pytest.mark.integration


def qwen2_dir(path: Path) -> Path:
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    torch.manual_seed(0)
    config = tiny_hf_config(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save(path)
    return path


def start_ranks(pipeline: Pipeline, extra: list[str]):
    args = ["--standalone", "--nproc-per-node", "2", "-m", "learner.main", *pipeline.overrides]
    log = pipeline.run_dir / "learner.log"
    pipeline.learner = Process("learner", "torch.distributed.run", [*args, *extra], log, cwd=ROOT)
    pipeline.learner.start()
    return pipeline.learner


COMMON = [
    "learner.groups_per_step=2",
    "learner.group_timeout_s=120",
    "actor.group_size=4",
    "run.torch_threads=1",
]


def ranks_pipeline(tmp_path: Path, redis_url: str, model: Path, extra: list[str]) -> Pipeline:
    """The pipeline of a 2-rank learner of ``model`` (run directory ``tmp_path / "run"``)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return Pipeline.make(run_dir, redis_url, model, [*COMMON, *extra])


def run_with_an_actor(pipeline: Pipeline, steps: int) -> None:
    """The 2 ranks and one actor until the learner has made ``steps`` steps and exited."""
    learner = start_ranks(pipeline, [f"run.steps={steps}"])
    pipeline.start_actor(0)
    assert wait_exit(learner, 600, pipeline) == 0, pipeline.log_tail("learner")


def test_two_rank_hf_learner_publishes_to_an_actor_and_resumes(tmp_path, redis_server):
    model = qwen2_dir(tmp_path / "qwen2")
    run_dir = tmp_path / "run"
    extra = [
        "learner.model_impl=hf",
        "learner.max_tokens_per_microbatch=256",
        "learner.checkpoint_every=2",
    ]
    pipeline = ranks_pipeline(tmp_path, redis_server.url, model, extra)
    try:
        run_with_an_actor(pipeline, 3)
        first = pipeline.steps()
        assert [r["learner/step"] for r in first] == [1, 2, 3]
        assert first[-1]["learner/version"] == 3
        learner = start_ranks(pipeline, ["run.steps=5"])
        assert wait_exit(learner, 300, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    resumed = pipeline.steps()[len(first) :]
    assert [r["learner/step"] for r in resumed] == [4, 5]
    # Republished as 4 on restart, then one version per step.
    assert [r["learner/version"] for r in resumed] == [5, 6]
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.name.endswith("00000005")
    # Sharded on 2 ranks (learner.checkpoint_format=auto): consolidated for transformers.
    assert is_sharded(ckpt)
    reopened = transformers.AutoModelForCausalLM.from_pretrained(
        export_checkpoint(ckpt, tmp_path / "exported")
    )
    assert type(reopened).__name__ == "Qwen2ForCausalLM"


def test_two_rank_learner_trains_and_publishes_the_eagle_head_an_actor_drafts_with(
    tmp_path, redis_server
):
    """spec=eagle3 with 2 learner ranks (torchrun, gloo): the head is trained on every step
    (its acceptance measured before each update), published inside every version, and the
    actor's engine drafts with the versions it loads."""
    model = warm_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    # Staleness 0: every step after the first trains groups the head of a published version drafted.
    extra = ["spec=eagle3", "spec.k=3", "learner.checkpoint_every=3", "learner.max_staleness=0"]
    pipeline = ranks_pipeline(tmp_path, redis_server.url, model, extra)
    try:
        run_with_an_actor(pipeline, 6)
    finally:
        pipeline.stop_all()
    steps = pipeline.steps()
    assert [r["learner/step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(0.0 <= r[mn.SPEC_DRAFT_ACCEPTANCE] <= 1.0 for r in steps)
    assert all(r[mn.SPEC_EAGLE_KL] > 0 for r in steps)
    # The actor drafted with heads the 2 ranks published (version 0 is the attached head, as
    # published at start). A step carries the actor's figure only when one of its groups brought
    # one (under load: [0, -, -, -] seen), so only its range is checked here.
    drafted = [r[mn.SPEC_DRAFT_VERSION] for r in steps if mn.SPEC_DRAFT_VERSION in r]
    assert drafted and all(0 <= v <= 6 for v in drafted), drafted
    # The head the ranks published moved away from the one the run started with.
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    path = export_checkpoint(ckpt, tmp_path / "exported") if is_sharded(ckpt) else ckpt
    trained = load_pretrained(path).eagle.state_dict()
    start = load_pretrained(model)
    attach_eagle(start)  # what the learner attached (deterministic: the policy's last layer)
    initial = start.eagle.state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in ("fc.weight", "lm_head.weight"))
