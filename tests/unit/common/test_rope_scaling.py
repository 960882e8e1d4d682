"""Static RoPE scaling (linear, llama3: Llama-3.1 and later) matches transformers' own logits."""

from pathlib import Path

import pytest
import torch
import transformers

from common.model import load_pretrained
from common.model_args import ModelArgs
from testing.own_model import tiny_hf_config

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        # Small, so that positions of the test sequence fall in all three frequency bands.
        "original_max_position_embeddings": 16,
    },
}


def hf_model(kind: str, scaling: dict, tmp_path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = tiny_hf_config(
        kind,
        vocab_size=97,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rope_scaling=dict(scaling),
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", sorted(SCALINGS))
def test_scaled_rope_logits_match_transformers(kind: str, rope: str, tmp_path: Path):
    reference = hf_model(kind, SCALINGS[rope], tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.args.rope_scaling["rope_type"] == rope
    ids = torch.randint(0, 97, (2, 120), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits.float()
        got = ours(ids)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
        # Negative control: the same weights with default RoPE compute something else.
        ours.args.rope_scaling = None
        assert (ours(ids) - expected).abs().max() > 10 * 2e-4


def test_scaling_survives_the_config_round_trip():
    args = ModelArgs(97, 64, 128, 2, 4, 2, rope_scaling=dict(SCALINGS["llama3"]))
    cfg = args.to_hf_config()
    assert cfg["rope_parameters"]["rope_type"] == "llama3"
    assert ModelArgs.from_hf_config(cfg) == args
    # transformers reads the same configuration back.
    hf = transformers.AutoConfig.for_model(**cfg)
    assert hf.rope_parameters["rope_type"] == "llama3"
    assert hf.rope_parameters["factor"] == 8.0


def test_default_rope_config_is_unchanged():
    cfg = ModelArgs(97, 64, 128, 2, 4, 2).to_hf_config()
    assert cfg["rope_scaling"] is None
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
