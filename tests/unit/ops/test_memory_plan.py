"""``specrl plan``: parameter counts are exact; sharding divides the state; the CLI prints."""

import json

import pytest

from common.model import Transformer
from common.model_args import ModelArgs
from ops.cli import main as cli_main
from ops.memory_plan import Shape, actor_plan, learner_plan


@pytest.mark.parametrize("bias,tied", [(False, False), (True, False), (False, True)])
def test_parameter_count_is_exact(bias, tied):
    args = ModelArgs(1000, 64, 160, 3, 4, 2, attention_bias=bias, tie_word_embeddings=tied)
    model = Transformer(args)
    shape = Shape.from_hf_config(args.to_hf_config())
    assert shape.params() == sum(p.numel() for p in model.parameters())


def test_sharding_and_precision_scale_the_state():
    shape = Shape.from_hf_config(ModelArgs(32000, 256, 688, 4, 4, 2).to_hf_config())
    one = learner_plan(shape, gpus=1, precision="fp32")
    two = learner_plan(shape, gpus=2, precision="fp32")
    assert one["weights"] + one["gradients"] + one["optimizer"] == 16 * shape.params()
    assert two["optimizer"] == one["optimizer"] / 2
    assert learner_plan(shape, precision="bf16")["optimizer"] == one["optimizer"] / 2
    ckpt = learner_plan(shape, checkpointing=True)["activations"]
    assert ckpt < learner_plan(shape, checkpointing=False)["activations"]
    kv = actor_plan(shape, seq_len=100, sequences=3)["kv_cache"]
    assert kv == 2 * 4 * 2 * 64 * 2 * 100 * 3


def test_cli_prints_a_plan(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(ModelArgs(500, 64, 128, 2, 4, 2).to_hf_config())
    )
    assert cli_main(["plan", str(tmp_path), "--gpus", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["learner"]["params"]
        == Shape.from_hf_config(json.loads((tmp_path / "config.json").read_text())).params()
    )
    assert out["actor"]["total"] > out["actor"]["weights"] > 0
