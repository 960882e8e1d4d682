"""Publishing under FSDP2 streams the state in the publish dtype (learner/distributed.py
``stream_full_state``): each shard cast on its rank, gathered one tensor at a time into rank 0's
buffer. On 2 gloo ranks (CPU), the bf16 values equal, bit for bit, the gathered fp32 state cast
to bf16; the buffer is refilled in place by the next refresh; a tied LM head is gathered once."""

import pytest
import torch

from learner.distributed import full_model_state, shard
from learner.versions import PolicyView
from testing.fsdp import group_rank, spawn_ranks
from testing.models import random_model

VOCAB = 37  # odd: the embedding's rows split unevenly over 2 ranks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _check_against_cast(view: PolicyView, module: torch.nn.Module) -> None:
    """Rank 0: the view's tensors are the gathered fp32 state cast to bf16, bit for bit."""
    reference = full_model_state(module)  # a collective: every rank calls it
    if view.dist is None or not view.dist.is_main:
        return
    state = view.state_dict()
    assert list(state) == list(reference)
    for name, t in reference.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        got = state[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(_bits(got), _bits(want)), name


def _worker(rank: int, world: int, port: int, tied: bool) -> None:
    with group_rank(rank, world, port) as ctx:
        module = shard(random_model(VOCAB, tie_word_embeddings=tied))
        view = PolicyView(module, module.policy.args, ctx, torch.bfloat16)
        view.refresh()
        _check_against_cast(view, module)
        storages = {n: t.data_ptr() for n, t in view.state_dict().items()}
        if rank == 0:
            assert {t.dtype for t in view.parameters()} == {torch.bfloat16}
            if tied:
                state = view.state_dict()
                assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
        with torch.no_grad():  # a new version: every rank changes its shards
            for p in module.parameters():
                p.mul_(1.0 + 1e-3 * (rank + 1))
        view.refresh()
        _check_against_cast(view, module)
        assert {n: t.data_ptr() for n, t in view.state_dict().items()} == storages
        ctx.barrier()


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_bf16_state_equals_the_cast_gathered_state(tied: bool) -> None:
    spawn_ranks(_worker, tied)


def test_one_process_view_is_the_live_state() -> None:
    model = random_model(VOCAB)
    view = PolicyView(model, model.args, None, torch.bfloat16)
    view.refresh()
    assert view.state_dict().keys() == model.state_dict().keys()
    assert next(iter(view.parameters())).dtype == torch.float32


def _nan_worker(rank: int, world: int, port: int) -> None:
    with group_rank(rank, world, port) as ctx:
        module = shard(random_model(VOCAB))
        view = PolicyView(module, module.policy.args, ctx, torch.bfloat16)
        assert view.refresh()
        before = {n: t.clone() for n, t in view.state_dict().items()}
        if rank == 1:  # one rank's shard only: rank 0 cannot see it without the collective
            with torch.no_grad():
                next(module.parameters()).to_local().view(-1)[0] = float("nan")
        assert not view.refresh()  # every rank: refused, nothing gathered
        assert view.refused == 1
        if rank == 0:  # the buffer still holds the last finite version
            state = view.state_dict()
            assert all(torch.equal(_bits(state[n]), _bits(t)) for n, t in before.items())
        ctx.barrier()


def test_a_non_finite_shard_refuses_the_version_on_every_rank_before_the_gather() -> None:
    spawn_ranks(_nan_worker)
