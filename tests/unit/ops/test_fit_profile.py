"""``learner.profile``: the settings the learner's start-up check picks from the model's config
and the device's memory, and its refusal with the estimate, on a Qwen2.5-7B-shaped config
(no weights: the estimate needs only config.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from common.config import load_config
from common.config.memory_fit import (
    USABLE_FRACTION,
    FitError,
    GiB,
    Profile,
    Shape,
    Workload,
    choose,
    estimate,
    learner_plan,
    user_set,
)
from common.process_start import prepare
from common.tasks import task_from_config
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.distributed import DistContext
from learner.prepare.fit_check import host_available, memory_facts
from learner.prepare.warm_start import tiny_model_args
from ops.cli import main as cli_main

# Qwen2.5-7B-Instruct's config.json (the fields the estimate reads).
QWEN_7B = {
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
SHAPE = Shape.from_hf_config(QWEN_7B)
CPU = torch.device("cpu")


def qwen_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    return tmp_path


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def test_qwen_shape_has_its_published_parameter_count():
    assert 7.61e9 < SHAPE.params() < 7.62e9  # 7.62B (Qwen's model card: 7.61B)


@pytest.mark.parametrize("profile", ["manual", "auto"])
def test_7b_on_one_80gib_device_is_refused_with_the_estimate(profile):
    cfg = load_config([f"learner.profile={profile}"])
    work = Workload.of(cfg, SHAPE, ranks=1)
    with pytest.raises(FitError) as e:
        choose(SHAPE, work, cfg.learner, 80 * GiB, "learner.device_memory_gib", "models/qwen")
    msg = str(e.value)
    P = SHAPE.params()
    # fp32 master weights, gradients and AdamW moments: 4 + 4 + 8 bytes/parameter, unsharded.
    state = f"weights {gib(4 * P)} + gradients {gib(4 * P)} + AdamW {gib(8 * P)}"
    assert state in msg and "weights 28.4 + gradients 28.4 + AdamW 56.7" in msg
    assert "80.0 GiB available (learner.device_memory_gib), 72.0 GiB usable" in msg
    assert f"learner.profile={profile}" in msg and "7.62B parameters on 1 rank" in msg
    if profile == "manual":  # the settings as given: fp32, the whole batch of 128 rows at once
        assert "precision=fp32, max_tokens_per_microbatch=0" in msg
        assert f"({128 * 32768} tokens)" in msg
        assert "These settings fit" not in msg  # on 1 device nothing does, whatever the settings
    else:  # the most frugal rung still holds 16 bytes/parameter
        assert "precision=bf16-mixed, max_tokens_per_microbatch=16384" in msg
        assert "activation_checkpointing=true, logprob_chunk_tokens=256" in msg
    # What would fit: the smallest number of FSDP2 ranks, and pure bf16 on this one.
    assert "It fits on 3 devices" in msg and "torchrun --nproc-per-node 3" in msg
    assert "LEARNER_GPUS=3" in msg
    assert "learner.precision=bf16" in msg
    two = learner_plan(SHAPE, 2, "bf16-mixed", 32768, 256, True)
    assert two["total"] > USABLE_FRACTION * 80 * GiB  # 2 ranks really do not fit
    # With a micro-batch budget the longest admitted row (the context) bounds the activations.
    assert ("a lower learner.max_seq_tokens shrinks it" in msg) == (profile == "auto")


def test_auto_fits_7b_on_four_80gib_devices_and_the_learner_takes_the_settings(tmp_path):
    cfg = load_config(["learner.device_memory_gib=80"])
    work = Workload.of(cfg, SHAPE, ranks=4)
    fit = choose(SHAPE, work, cfg.learner, 80 * GiB)
    assert fit.profile == Profile("bf16-mixed", 16384, True, 1024)
    assert fit.plan["total"] <= USABLE_FRACTION * 80 * GiB
    # The rung before it (no checkpointing) does not fit: auto picked the first that does.
    before = estimate(SHAPE, work, Profile("bf16-mixed", 16384, False, 1024))
    assert before["total"] > USABLE_FRACTION * 80 * GiB
    assert fit.plan["weights"] == 4 * SHAPE.params() / 4  # fp32 master weights, sharded over 4
    # At start (rank 0 of 4; the memory is given, so no collective runs): the learner's config
    # now holds the picked settings, which setup() and every trainer reads.
    rank0 = DistContext(rank=0, world=4, local_rank=0, device=CPU)
    memory = memory_facts(cfg, qwen_dir(tmp_path), CPU, rank0)
    assert memory is not None and memory.ranks == 4
    resolution = prepare(cfg, [], "learner", memory)
    assert Profile.of(cfg.learner) == fit.profile
    assert {c.layer for c in resolution.changes} == {"memory"}
    assert "learner memory (profile auto, changed to fit)" in resolution.notes[0]


def test_tiny_default_is_unchanged(tmp_path):
    cfg = load_config([])
    before = copy.deepcopy(cfg.learner)
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    args = tiny_model_args(cfg, tokenizer, task_from_config(cfg.task))
    (tmp_path / "config.json").write_text(json.dumps(args.to_hf_config()))
    assert (host_available() or 0) > 0
    memory = memory_facts(cfg, tmp_path, CPU)  # measured: this host's available RAM
    assert memory is not None and memory.available > 0
    assert [c for c in prepare(cfg, [], "learner", memory).changes if c.layer == "memory"] == []
    assert cfg.learner == before
    fit = choose(memory.shape, Workload.of(cfg, memory.shape, 1), cfg.learner, memory.available)
    assert fit.profile == Profile("fp32", 0, False, 1024)
    # Its worst-case whole batch (128 rows of the model's 128-token context) needs well under
    # 1 GiB: nothing changes there either.
    assert fit.plan["total"] < 0.5 * GiB
    cfg.learner.device_memory_gib = 1
    prepare(cfg, [], "learner", memory_facts(cfg, tmp_path, CPU))
    assert Profile.of(cfg.learner) == Profile.of(before)


def test_user_settings_are_kept(tmp_path):
    # A value other than the dataclass default is the user's, from the command line...
    cfg = load_config(["learner.max_tokens_per_microbatch=65536"])
    assert user_set(cfg.learner) == {"max_tokens_per_microbatch"}
    fit = choose(SHAPE, Workload.of(cfg, SHAPE, 4), cfg.learner, 80 * GiB)
    assert fit.profile == Profile("bf16-mixed", 65536, True, 1024)  # kept; the rest picked
    # ...or from a YAML group (the real-model preset sets all four).
    preset = load_config(["model=smollm2-135m"])
    assert user_set(preset.learner) == {
        "precision",
        "max_tokens_per_microbatch",
        "activation_checkpointing",
        "logprob_chunk_tokens",
    }
    # A user setting that cannot fit is refused, naming the settings that would.
    cfg = load_config(["learner.logprob_chunk_tokens=0"])
    with pytest.raises(FitError) as e:
        choose(SHAPE, Workload.of(cfg, SHAPE, 4), cfg.learner, 80 * GiB)
    msg = str(e.value)
    assert "logprob_chunk_tokens=0;" in msg  # the estimate is of the kept setting
    assert "Kept as set: learner.logprob_chunk_tokens=0" in msg
    assert "These settings fit" in msg and "learner.logprob_chunk_tokens=256" in msg
    # manual: the settings as given, refused even where auto would fit.
    cfg = load_config(["learner.profile=manual"])
    with pytest.raises(FitError, match="learner.profile=manual uses the settings as given"):
        choose(SHAPE, Workload.of(cfg, SHAPE, 4), cfg.learner, 80 * GiB)
    # off: no estimate, nothing changed (even on a device of 1 GiB).
    cfg = load_config(["learner.profile=off", "learner.device_memory_gib=1"])
    assert memory_facts(cfg, qwen_dir(tmp_path), CPU) is None
    assert Profile.of(cfg.learner) == Profile("fp32", 0, False, 1024)


def test_plan_prints_what_auto_picks(tmp_path, capsys):
    model = qwen_dir(tmp_path)
    assert cli_main(["plan", str(model), "--gpus", "4", "--memory-gib", "80", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["overrides"] == Profile("bf16-mixed", 16384, True, 1024).overrides()
    assert cli_main(["plan", str(model), "--memory-gib", "80"]) == 0
    assert "It fits on 3 devices" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a GPU host gets its cores / GPUs")
def test_torch_threads_default_is_one_without_a_gpu():
    assert load_config([]).run.torch_threads == 1
    assert load_config(["run.torch_threads=3"]).run.torch_threads == 3
