"""``specrl plan`` on transformers layouts the built-in model does not compute: the parameter
count read from the config is within 1% of the model's own, and the plan names the engines that
roll the model out."""

import json

import pytest
import torch
import transformers

from ops.cli import main as cli_main
from testing.models import FOREIGN_LAYOUTS
from testing.shapes import shape

SHAPE = shape(1000, 256, 704, 4, 4, 2, head_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_config(model_type: str, path) -> int:
    """``config.json`` of a ``model_type`` model of :data:`SHAPE` in ``path``; its parameter
    count (the model built on the meta device)."""
    fields = {**SHAPE, **FOREIGN_LAYOUTS.get(model_type, {})}
    if model_type == "gemma3_text":
        fields["layer_types"] = ["sliding_attention", "full_attention"] * 2
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    (path / "config.json").write_text(config.to_json_string())
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", [*sorted(FOREIGN_LAYOUTS), "olmo2"])
def test_plan_counts_the_parameters_of_other_layouts(model_type, tmp_path, capsys):
    params = write_config(model_type, tmp_path)
    assert cli_main(["plan", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["learner"]["params"] - params) / params < 0.01
    assert out["actor"]["weights"] == 2 * out["learner"]["params"]  # bf16 serving weights
    assert out["rollout"]["engines"] == ["vllm"]
    assert f"engine=torch: unsupported model_type={model_type!r}" in out["rollout"]["refused"]


def test_plan_prints_the_engines(tmp_path, capsys):
    write_config("gemma3_text", tmp_path)
    assert cli_main(["plan", str(tmp_path)]) == 0
    assert "rollout engines: engine=vllm  (engine=torch: unsupported" in capsys.readouterr().out
    # A model_type transformers does not know: its config.json must carry every key itself.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mine", "vocab_size": 10}))
    assert cli_main(["plan", str(tmp_path)]) == 1
    assert "has no 'num_attention_heads'" in capsys.readouterr().err
