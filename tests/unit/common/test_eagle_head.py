"""The policy's EAGLE-3 head (common/eagle.py): its inputs, its computation, its place in a
checkpoint and in the KV cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.eagle import EAGLE_FILE, EAGLE_PREFIX, attach_eagle
from common.layers import KVCache
from common.model import Transformer, load_pretrained, save_pretrained
from common.model_args import ModelArgs, default_eagle_aux_layers
from testing.shapes import shape

ARGS = ModelArgs(**shape(96, 64, 128, 6, 2, 1))


def policy(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(replace(ARGS, **changes)).eval()
    attach_eagle(model, vocab_ids=torch.arange(10, 74), seed=seed + 1, init="random")
    return model


def test_default_inputs_are_vllms_and_bad_ones_are_refused():
    assert default_eagle_aux_layers(32) == (2, 16, 29)
    assert default_eagle_aux_layers(6) == (2, 3)
    assert default_eagle_aux_layers(2) == (0, 1, 2)
    with pytest.raises(ValueError, match="eagle_aux_layers"):
        replace(ARGS, eagle_aux_layers=(3, 2))
    with pytest.raises(ValueError, match="eagle_aux_layers"):
        replace(ARGS, eagle_aux_layers=(7,))
    with pytest.raises(ValueError, match="eagle_vocab_size"):
        replace(ARGS, eagle_vocab_size=8)


def test_aux_states_are_the_residual_stream_after_those_layers_split_or_not():
    model = policy()
    ids = torch.randint(0, 96, (2, 7))
    x = model.model.embed_tokens(ids)
    expected, h = [], x
    for i in range(6):
        if i in model.args.eagle_aux_layers:
            expected.append(h)
        h = model.run_layers(h, None, None, i, i + 1)
    whole: list[torch.Tensor] = []
    model.run_layers(x, None, None, 0, 6, aux=whole)
    split: list[torch.Tensor] = []
    mid = model.run_layers(x, None, None, 0, 3, aux=split)
    model.run_layers(mid, None, None, 3, 6, aux=split)
    assert len(whole) == len(split) == len(expected) == 2
    for a, b, c in zip(whole, split, expected, strict=True):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def reference_step(model: Transformer, next_ids, hidden) -> torch.Tensor:
    """vLLM's Eagle3 Llama layer written out with plain ops (no cache, causal)."""
    head, args = model.eagle, model.args
    layer = head.midlayer

    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + args.rms_norm_eps))

    e = model.model.embed_tokens(next_ids)
    x = torch.cat([rms(e, layer.input_layernorm.weight), rms(hidden, layer.hidden_norm.weight)], -1)
    attn = layer.self_attn
    B, T, _ = x.shape
    D = args.head_dim
    q = (x @ attn.q_proj.weight.T).view(B, T, 2, D).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(B, T, 1, D).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(B, T, 1, D).transpose(1, 2)
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t):
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return t * cos + torch.cat([-b, a], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ k.transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 2 * D) @ attn.o_proj.weight.T
    r = hidden + o
    m = layer.mlp
    y = rms(r, layer.post_attention_layernorm.weight)
    return r + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ (
        m.down_proj.weight.T
    )


@torch.no_grad()
def test_a_step_computes_vllms_eagle3_layer_and_its_kv_lands_in_its_own_cache_layer():
    model = policy()
    ids = torch.randint(0, 96, (2, 6))
    aux: list[torch.Tensor] = []
    model.run_layers(model.model.embed_tokens(ids), None, None, 0, 6, aux=aux)
    g = model.eagle.combine(aux)
    nxt = torch.roll(ids, -1, dims=1)
    out = model.run_eagle(nxt, g, None, None)
    torch.testing.assert_close(out, reference_step(model, nxt, g), rtol=1e-4, atol=1e-5)
    # The same step over a cache, in two chunks, gives the same states and fills only the head's
    # layer of the cache.
    cache = KVCache(model.args, 2, 16)
    assert model.args.cache_layers == 7 and model.args.eagle_cache_layer == 6
    pos = torch.arange(6).expand(2, 6)
    first = model.run_eagle(nxt[:, :4], g[:, :4], pos[:, :4], cache)
    second = model.run_eagle(nxt[:, 4:], g[:, 4:], pos[:, 4:], cache)
    torch.testing.assert_close(torch.cat([first, second], 1), out, rtol=1e-4, atol=1e-5)
    assert cache.k[6].abs().sum() > 0 and cache.k[:6].abs().sum() == 0
    logits = model.eagle.logits(out)
    assert logits.shape == (2, 6, 64) and logits.dtype == torch.float32
    # Draft ids map to the target ids they stand for.
    assert model.eagle.to_target(torch.tensor([0, 63])).tolist() == [10, 73]
    torch.testing.assert_close(model.eagle.vocab_ids, torch.arange(10, 74))


def test_a_fresh_head_starts_from_the_policys_head_rows_and_norm():
    model = policy()
    torch.testing.assert_close(model.eagle.lm_head.weight, model.lm_head.weight[10:74])
    torch.testing.assert_close(model.eagle.norm.weight, model.model.norm.weight)


@torch.no_grad()
def test_a_head_started_from_the_last_layer_is_that_layer_on_the_top_aux_state():
    torch.manual_seed(5)
    model = Transformer(ARGS).eval()
    attach_eagle(model, vocab_ids=torch.arange(10, 74))  # init="layer", the default
    head, last = model.eagle, model.model.layers[-1]
    ids = torch.randint(0, 96, (2, 7))
    aux: list[torch.Tensor] = []
    model.run_layers(model.model.embed_tokens(ids), None, None, 0, 6, aux=aux)
    g = model.eagle.combine(aux)
    torch.testing.assert_close(g, aux[-1])  # fc = [0 | I]: the top auxiliary state (layer 3)
    # q/k/v read norm(g) only, with the layer's input norm: the head's step is the policy's last
    # decoder layer on g (causal, positions 0 ..), whatever the next tokens are.
    _, _, cos, sin = model._attention_inputs(g, None, None)
    expected = last(g, cos, sin, None, None)
    out = model.run_eagle(ids, g, None, None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    other = model.run_eagle(torch.roll(ids, 1, dims=1), g, None, None)
    torch.testing.assert_close(other, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.midlayer.hidden_norm.weight, last.input_layernorm.weight)
    # Reading the state before the last layer (aux layer 5 of 6), the head's first draft is then
    # exactly the policy's own next-token logits over the draft vocabulary.
    model2 = Transformer(ARGS).eval()
    attach_eagle(model2, aux_layers=(2, 5), vocab_ids=torch.arange(10, 74))
    taps: list[torch.Tensor] = []
    h = model2.run_layers(model2.model.embed_tokens(ids), None, None, 0, 6, aux=taps)
    drafted = model2.eagle.logits(model2.run_eagle(ids, model2.eagle.combine(taps), None, None))
    torch.testing.assert_close(drafted, model2.head(h)[..., 10:74], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="init"):
        attach_eagle(model2, init="zeros")


def test_sharpening_rescales_the_published_rows_not_the_trained_logits():
    model = policy()
    h = torch.randn(3, 64)
    trained, published = model.eagle.trained_logits(h), model.eagle.logits(h)
    torch.testing.assert_close(trained, published)
    model.eagle.set_sharpening(0.5)
    torch.testing.assert_close(model.eagle.logits(h), 2.0 * published)  # drafts from z / (T s)
    torch.testing.assert_close(model.eagle.trained_logits(h), trained)
    model.eagle.set_sharpening(0.7)  # from the current s, not compounded
    torch.testing.assert_close(model.eagle.logits(h), published / 0.7)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="sharpening"):
            model.eagle.set_sharpening(bad)


@pytest.mark.parametrize("layout", [{}, {"attention_bias": True}, {"qk_norm": True}])
def test_the_head_round_trips_through_a_checkpoint_of_each_layout(tmp_path, layout):
    model = policy(**layout)
    save_pretrained(model, tmp_path)
    assert (tmp_path / EAGLE_FILE).is_file()
    back = load_pretrained(tmp_path)
    assert back.args == model.args and back.eagle is not None
    for name, t in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], t)
    names = {n for n in model.state_dict() if n.startswith(EAGLE_PREFIX)}
    assert "eagle.midlayer.self_attn.q_proj.weight" in names and "eagle.d2t" in names
    assert model.state_dict()["eagle.midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    # The head is Llama-form whatever the policy's layout: no bias, no q/k norm.
    assert not any("bias" in n or "q_norm" in n for n in names)
    # A checkpoint without the head loads as a plain policy and writes no head file.
    plain = Transformer(ARGS)
    save_pretrained(plain, tmp_path)
    assert not (tmp_path / EAGLE_FILE).exists() and load_pretrained(tmp_path).eagle is None
