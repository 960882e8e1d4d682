"""The GPU profile (common/config/gpu_profile.py) and its start-up path (common/process_start.py, the resolve step):
the defaults it picks for a header-only Qwen2.5-7B and a 135M model on an H100, a user's value
kept, an unusual learning rate refused or warned about, and nothing changed without CUDA."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common import process_start
from common.config import SpecRLConfig, load_config, to_yaml
from common.config.gpu_profile import (
    Devices,
    TaskFacts,
    UnusualLearningRate,
    eos_token_ids,
    explicit_keys,
    gpu_profile,
    model_parameters,
)
from common.entrypoint import run_main

# Qwen2.5-7B-Instruct's config.json and generation_config.json, as published (header only).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN25_7B_GENERATION = {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}
# SmolLM2-135M-Instruct's config.json (tied embeddings).
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "eos_token_id": 2,
}
H100 = Devices(cuda=True, count=8, name="NVIDIA H100 80GB HBM3", memory_gib=79.6, capability=(9, 0))
CPU = Devices(cuda=False)
# A MATH-like task: prompts up to 300 tokens, 1,024 new tokens.
MATH_LIKE = TaskFacts(max_prompt_tokens=300, max_new_tokens=1024, source="test")


def vllm_cfg(**learner: object) -> SpecRLConfig:
    cfg = SpecRLConfig()
    cfg.engine = replace(cfg.engine, name="vllm")
    for key, value in learner.items():
        setattr(cfg.learner, key, value)
    return cfg


def qwen_profile(cfg: SpecRLConfig | None = None, explicit=(), devices=H100):
    cfg = cfg or vllm_cfg()
    return gpu_profile(QWEN25_7B, QWEN25_7B_GENERATION, devices, MATH_LIKE, cfg, explicit)


def test_qwen25_7b_profile_on_an_h100():
    assert model_parameters(QWEN25_7B) == pytest.approx(7.615e9, rel=1e-3)  # 7.62B published
    profile = qwen_profile()
    assert profile.changes() == {
        "learner.lr": 1e-6,
        "learner.lr_warmup_steps": 12,  # 3% of run.steps=400
        "learner.precision": "bf16-mixed",
        "learner.publish_dtype": "bfloat16",
        "run.tf32": True,
        # 300 + 1024 = 1324, rounded up to a multiple of 128.
        "engine.vllm_max_model_len": 1408,
        "learner.max_seq_tokens": 1408,
        "actor.prompts_per_batch": 32,  # 256 rows of group_size 8
        "learner.groups_per_step": 64,  # 512 completions per optimizer step
        "learner.queue_max": 64,  # the next step's groups wait while a step trains
        "actor.outbox_max": 32,  # a whole call's groups go out without waiting for acks
        "learner.tis_cap": 2.0,
        "learner.max_staleness_from_lag": 8,  # the bound follows the measured delivery lag
        "engine.vllm_stop_token_ids": [151645, 151643],
    }
    assert profile.warnings == ()
    synchronous = vllm_cfg()
    synchronous.actor.wait_for_new_version = True
    tied = qwen_profile(synchronous).changes()
    assert not {"actor.prompts_per_batch", "learner.groups_per_step"} & set(tied)
    table = profile.table()
    assert "7.62B parameters on 8 x NVIDIA H100 80GB HBM3" in table
    assert "learner.lr" in table and "= 1e-06 (" in table and "verl/OpenRLHF/prime-rl" in table
    assert re.search(
        r"engine.vllm_stop_token_ids +\= \[151645, 151643\] \(every eos_token_id", table
    )


def test_the_staleness_bound_follows_the_delivery_lag_except_on_policy():
    assert "learner.max_staleness_from_lag" not in qwen_profile(vllm_cfg(max_staleness=0)).changes()
    assert (
        qwen_profile(vllm_cfg(max_staleness=10)).changes()["learner.max_staleness_from_lag"] == 10
    )
    kept = qwen_profile(vllm_cfg(), explicit={"learner.max_staleness_from_lag"})
    assert "learner.max_staleness_from_lag" not in kept.changes()


def test_every_eos_id_of_the_generation_config():
    assert eos_token_ids(QWEN25_7B_GENERATION, QWEN25_7B) == [151645, 151643]
    assert eos_token_ids({"eos_token_id": 128009}, {}) == [128009]  # an int
    llama3 = {"eos_token_id": [128001, 128008, 128009, 128001]}
    assert eos_token_ids(llama3, {}) == [128001, 128008, 128009]  # in order, once each
    assert eos_token_ids(None, QWEN25_7B) == [151645]  # no generation_config.json
    assert eos_token_ids({}, {}) == []


def test_the_torch_engine_gets_no_stop_ids_and_a_warning():
    profile = qwen_profile(SpecRLConfig())  # engine=torch
    assert "engine.vllm_stop_token_ids" not in profile.changes()
    assert any("[151645, 151643]" in w and "engine=vllm" in w for w in profile.warnings)


def test_max_model_len_is_capped_at_the_models_context():
    long_task = TaskFacts(max_prompt_tokens=32000, max_new_tokens=2048, source="test")
    profile = gpu_profile(QWEN25_7B, None, H100, long_task, vllm_cfg(), ())
    assert profile.changes()["engine.vllm_max_model_len"] == 32768
    assert any("exceed the model's context (32768)" in w for w in profile.warnings)
    unknown = gpu_profile(QWEN25_7B, None, H100, TaskFacts(), vllm_cfg(), ())
    assert "engine.vllm_max_model_len" not in unknown.changes()


def test_rows_shrink_to_the_kv_cache_a_smaller_gpu_holds():
    small = replace(H100, name="NVIDIA L4", memory_gib=22.0, capability=(8, 9))
    rows = qwen_profile(devices=small).changes()["actor.prompts_per_batch"] * 8
    # 0.9 x 22 GiB less 1.1 x 15.2 GB of bf16 weights leaves ~4.3 GB: 57 KiB of KV per token.
    assert 8 <= rows < 256


def test_a_gpu_without_bf16_keeps_fp32():
    t4 = replace(H100, name="Tesla T4", memory_gib=15.0, capability=(7, 5))
    changes = qwen_profile(devices=t4).changes()
    assert not {"learner.precision", "learner.publish_dtype", "run.tf32"} & set(changes)


def test_an_explicit_user_value_wins():
    cfg = vllm_cfg(lr=2e-6, precision="fp32")
    cfg.engine.vllm_max_model_len = 4096
    keys = explicit_keys(
        ["learner.lr=2e-6", "learner.precision=fp32", "engine.vllm_max_model_len=4096"], cfg
    )
    assert keys == {"learner.lr", "learner.precision", "engine.vllm_max_model_len"}
    profile = qwen_profile(cfg, keys)
    changes = profile.changes()
    assert not {"learner.lr", "learner.precision", "engine.vllm_max_model_len"} & set(changes)
    kept = {s.key: s.value for s in profile.settings if s.kept}
    assert kept == {
        "learner.lr": 2e-6,
        "learner.precision": "fp32",
        "engine.vllm_max_model_len": 4096,
    }
    assert changes["learner.publish_dtype"] == "bfloat16"  # the rest still chosen
    assert "yours; the profile: 1e-06" in profile.table()


def test_explicit_keys_from_the_command_line_and_from_group_options():
    cfg = SpecRLConfig()
    # Named on the command line, even at the dataclass default (3e-4 is what is refused at 7B).
    assert explicit_keys(["learner.lr=3e-4", "+learner.lr_warmup_steps=0"], cfg) == {
        "learner.lr",
        "learner.lr_warmup_steps",
    }
    assert explicit_keys(["engine=vllm", "model.path=/m"], cfg) == frozenset()
    # A model preset's YAML sets values chosen for its model: they count as set.
    preset = load_config(["model=smollm2-135m", "task=word_problems"])
    assert {"learner.lr", "learner.precision", "learner.publish_dtype"} <= explicit_keys([], preset)


def test_3e4_at_7b_is_refused_with_its_reason():
    cfg = vllm_cfg(lr=3e-4)
    with pytest.raises(UnusualLearningRate) as refused:
        qwen_profile(cfg, {"learner.lr"})
    message = str(refused.value)
    for part in ("learner.lr=0.0003", "7.62B-parameter model", "2e-07..3e-06", "3e-05"):
        assert part in message
    assert "learner.allow_unusual_lr=true" in message


def test_3e4_at_7b_runs_with_the_acknowledgement_as_a_warning():
    cfg = vllm_cfg(lr=3e-4, allow_unusual_lr=True)
    profile = qwen_profile(cfg, {"learner.lr", "learner.allow_unusual_lr"})
    assert "learner.lr" not in profile.changes()
    [warning] = [w for w in profile.warnings if "learner.lr=0.0003" in w]
    assert "far above" in warning and "allow_unusual_lr=true: running with it" in warning
    # Inside the range: no warning; a little above it: a warning, not a refusal.
    assert not qwen_profile(vllm_cfg(lr=1e-6), {"learner.lr"}).warnings
    near = qwen_profile(vllm_cfg(lr=1e-5), {"learner.lr"}).warnings
    assert any("above the usual range" in w for w in near)


def test_a_small_model_gets_a_larger_learning_rate():
    assert model_parameters(SMOLLM2_135M) == pytest.approx(134.5e6, rel=1e-2)
    profile = gpu_profile(SMOLLM2_135M, None, H100, MATH_LIKE, vllm_cfg(), ())
    small_lr, big_lr = profile.changes()["learner.lr"], qwen_profile().changes()["learner.lr"]
    assert small_lr == 1e-5 and small_lr > big_lr
    # The preset's own 2e-5 is in range at this size: kept, and not warned about.
    preset = gpu_profile(SMOLLM2_135M, None, H100, MATH_LIKE, vllm_cfg(lr=2e-5), {"learner.lr"})
    assert not [w for w in preset.warnings if "learner.lr" in w]


def test_no_cuda_no_profile():
    assert qwen_profile(devices=CPU).settings == ()
    # Without CUDA even 3e-4 at 7B goes through as before.
    assert qwen_profile(vllm_cfg(lr=3e-4), {"learner.lr"}, devices=CPU).changes() == {}


def qwen_dir(tmp_path: Path) -> Path:
    model = tmp_path / "qwen7b"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    (model / "generation_config.json").write_text(json.dumps(QWEN25_7B_GENERATION))
    return model


def test_cpu_start_changes_nothing(tmp_path, monkeypatch):
    """The entry points on a machine without CUDA: the same config as before, a real model or
    not, learner or actor, and no file of the model read."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    read = []
    monkeypatch.setattr(process_start, "read_json", lambda p: read.append(p))
    args = [f"model.path={qwen_dir(tmp_path)}", "engine=vllm", "learner.lr=3e-4"]
    for role in ("learner", "actor"):
        seen: list[SpecRLConfig] = []
        assert run_main(args, "specrl-x", "", seen.append, role=role) == 0
        assert to_yaml(seen[0]) == to_yaml(load_config(args))
    assert read == []
    tiny = load_config([])
    before = to_yaml(tiny)
    assert process_start.prepare(tiny, [], "learner").profile is None
    assert to_yaml(tiny) == before


def on_an_h100(monkeypatch) -> None:
    monkeypatch.setattr(process_start, "describe_devices", lambda cfg, role: H100)
    monkeypatch.setattr(process_start, "task_facts", lambda cfg, model_dir: MATH_LIKE)


def learner_run(seen: list[SpecRLConfig]):
    """The learner's run as far as the resolve step: ``setup`` resolves once its memory is
    known (here: none, as with ``learner.profile=off``), with the command line run_main kept."""

    def run(cfg: SpecRLConfig) -> None:
        process_start.prepare(cfg, None, "learner")
        seen.append(cfg)

    return run


def test_gpu_start_applies_each_roles_sections(tmp_path, monkeypatch, capsys):
    on_an_h100(monkeypatch)
    args = [f"model.path={qwen_dir(tmp_path)}", "engine=vllm", "learner.precision=fp32"]
    seen: list[SpecRLConfig] = []
    run_main(args, "specrl-learner", "", learner_run(seen), role="learner")
    run_main(args, "specrl-actor", "", seen.append, role="actor")
    learner, actor = seen
    assert (learner.learner.lr, learner.learner.precision) == (1e-6, "fp32")  # fp32: yours
    assert (learner.learner.publish_dtype, learner.run.tf32) == ("bfloat16", True)
    assert learner.engine.vllm_max_model_len == 512  # an actor's setting, not the learner's
    assert actor.learner.lr == 3e-4  # a learner's setting, not the actor's
    assert actor.engine.vllm_max_model_len == 1408
    assert actor.engine.vllm_stop_token_ids == [151645, 151643]
    assert actor.actor.prompts_per_batch == 32
    assert (learner.learner.groups_per_step, actor.learner.groups_per_step) == (64, 16)
    logged = capsys.readouterr().err  # the entry point's logging (parse) writes to stderr
    assert logged.count("GPU profile for 7.62B parameters") == 2  # once per process
    assert re.search(r"learner.lr +\= 1e-06 \(7.62B parameters", logged)
    refused = [f"model.path={qwen_dir(tmp_path / 'again')}", "learner.lr=3e-4"]
    with pytest.raises(SystemExit, match=r"specrl-learner: invalid configuration: learner.lr="):
        run_main(refused, "specrl-learner", "", learner_run(seen), role="learner")
    off = [*refused, "run.gpu_profile=false"]
    run_main(off, "specrl-learner", "", learner_run(seen), role="learner")
    assert seen[-1].learner.lr == 3e-4


def test_each_process_logs_the_warnings_of_its_sections(tmp_path, monkeypatch, caplog):
    """The learner of the compose recipe has engine=torch in its config (ACTOR_ARGS set
    engine=vllm for the actors only): the torch engine's EOS warning is not its to log."""
    on_an_h100(monkeypatch)
    caplog.set_level(logging.WARNING, logger="common.process_start")
    args = [f"model.path={qwen_dir(tmp_path)}"]
    process_start.prepare(load_config(args), args, "learner")
    assert "engine=torch stops on" not in caplog.text
    process_start.prepare(load_config(args), args, "actor")
    assert "engine=torch stops on the tokenizer's EOS only" in caplog.text


def test_a_gpu_node_on_the_tiny_model_says_what_it_runs(monkeypatch, caplog):
    on_an_h100(monkeypatch)
    caplog.set_level(logging.WARNING, logger="common.process_start")
    cfg = load_config([])
    before = to_yaml(cfg)
    assert process_start.prepare(cfg, [], "actor").profile is None
    assert not caplog.records  # said once, by the learner
    assert process_start.prepare(cfg, [], "learner").profile is None
    [record] = caplog.records
    for part in ("built-in tiny model", "torch engine", "one GPU", "compose_gpu.py", "--model-dir"):
        assert part in record.message
    assert "docs/deployment.md" in record.message
    assert to_yaml(cfg) == before


def test_task_facts_tokenize_the_longest_prompts_as_the_actors_do(tmp_path):
    from common.prompts import prompt_encoder
    from common.tokenizer import HFTokenizer
    from testing.own_model import build_tokenizer

    model = tmp_path / "model"
    build_tokenizer(model)
    data = tmp_path / "train.jsonl"
    prompts = ["Tom has 3 apples.", "A train travels 60 miles in 2 hours. " * 6, "Mia reads."]
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    cfg = load_config(["task=dataset", f"task.path={data}", f"model.path={model}"])
    facts = process_start.task_facts(cfg, model)
    encode = prompt_encoder(HFTokenizer(model), "auto", "", dataset=True)
    assert facts.max_prompt_tokens == max(len(encode(p)) for p in prompts)
    assert facts.max_prompt_tokens > len(encode(prompts[0])) + 20  # the chat template counted
    assert facts.max_new_tokens == 256  # the data set task's default
    missing = replace(cfg.task, path=str(tmp_path / "gone.jsonl"))
    assert process_start.task_facts(replace(cfg, task=missing), model).max_prompt_tokens == 0


def test_learning_rate_warm_up_ramps_the_policy_group_only():
    from learner.optim import warm_up_lr

    cfg = vllm_cfg(lr=1e-6, lr_warmup_steps=4).learner
    policy, draft = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [policy]}, {"params": [draft], "lr": 1e-3}], lr=cfg.lr)
    ramp = []
    for step in range(6):
        warm_up_lr(opt, cfg, step)
        ramp.append(opt.param_groups[0]["lr"])
    assert ramp == pytest.approx([0.25e-6, 0.5e-6, 0.75e-6, 1e-6, 1e-6, 1e-6])
    assert opt.param_groups[1]["lr"] == 1e-3
    opt.param_groups[0]["lr"] = 5.0
    warm_up_lr(opt, replace(cfg, lr_warmup_steps=0), 0)  # no warm-up: untouched
    assert opt.param_groups[0]["lr"] == 5.0


def test_vllm_rollouts_end_on_any_stop_id():
    from actors.engines.vllm.engine import _Slot

    slot = _Slot(prompt=[1, 2], tokens=[5, 151643], logprobs=[-0.1, -0.2], versions=[0, 0])
    assert slot.rollout([151645, 151643]).finished
    assert not slot.rollout([151645]).finished


def test_the_pipeline_is_sized_for_a_step_and_a_call_and_a_larger_user_value_is_kept():
    cfg = vllm_cfg(queue_max=128)
    changes = qwen_profile(cfg, explicit={"learner.queue_max"}).changes()
    assert "learner.queue_max" not in changes  # the user's 128 already holds a step's 64
    assert changes["actor.outbox_max"] == 32
    small = qwen_profile(vllm_cfg(queue_max=4), explicit={"learner.queue_max"})
    assert "learner.queue_max" not in small.changes()  # the user's 4 is kept...
    assert "= 4 (yours; the profile: 64)" in small.table()  # ...and shown
