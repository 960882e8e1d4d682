"""A published version of a policy with an EAGLE-3 head carries the head: its tensors
(``eagle.*``) and, in the manifest's config, its inputs and vocabulary, so an actor rebuilds the
same head from the version alone (actors/wiring.py ``policy_from_state``)."""

from __future__ import annotations

import pytest
import redis
import torch

from actors.wiring import policy_from_state
from common.config.actor import SpecConfig
from common.eagle import EAGLE_PREFIX, attach_eagle
from common.model_args import ModelArgs, layout_from_hf_config
from common.policy_meta import check_rollout_support, hf_config_from_meta, layout_from_meta
from common.tokenizer import CharTokenizer
from common.weights.fetch.reader import WeightReader
from common.weights.publish.publisher import Publisher
from common.weights.publish.writer import WeightWriter
from learner.policy import model_args
from learner.wiring import attach_eagle_head
from testing.models import random_hf_model, random_model

RUN = "eagle-publish-run"


def _head_outputs(model, ids: torch.Tensor) -> torch.Tensor:
    aux: list[torch.Tensor] = []
    L = model.args.num_hidden_layers
    with torch.no_grad():
        model.run_layers(model.model.embed_tokens(ids), None, None, 0, L, aux=aux)
        out = model.run_eagle(ids[:, 1:], model.eagle.combine(aux)[:, :-1], None, None)
        return model.eagle.logits(out)


@pytest.mark.parametrize("upload", ["thread", "process"])
def test_versions_carry_the_head_and_actors_rebuild_it(
    redis_client: redis.Redis, upload: str
) -> None:
    model = random_model(16, hidden_size=32, intermediate_size=64, num_hidden_layers=3).train()
    attach_eagle(model, aux_layers=(0, 2), vocab_ids=torch.tensor([1, 4, 5, 9, 15]), seed=2)
    store = WeightWriter(redis_client, RUN, chunk_bytes=1024, keyframe_every=3)
    pub = Publisher(store, model, CharTokenizer("abcdefghijklm"), upload=upload)
    pub.publish(1)
    with torch.no_grad():
        model.eagle.fc.weight.add_(0.5)  # a step of the head's training: the next version
    pub.publish(2)
    pub.close()
    reader = WeightReader(redis_client, RUN)
    for version in (1, 2):
        manifest = reader.manifest(version)
        config = hf_config_from_meta(manifest["meta"])
        assert config["eagle_aux_layers"] == [0, 2] and config["eagle_vocab_size"] == 5
        layout = layout_from_meta(manifest["meta"])
        assert isinstance(layout, ModelArgs) and layout.has_eagle
        _, state = reader.fetch(version)
        head = {k for k in state if k.startswith(EAGLE_PREFIX)}
        assert head == {EAGLE_PREFIX + k for k in model.eagle.state_dict()}
        assert state["eagle.d2t"].dtype == torch.long
    assert torch.equal(state["eagle.fc.weight"], model.eagle.fc.weight.detach())
    rebuilt = policy_from_state(layout, state, torch.device("cpu"), torch.float32)
    assert torch.equal(rebuilt.eagle.vocab_ids, torch.tensor([1, 4, 5, 9, 15]))
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_head_outputs(rebuilt, ids), _head_outputs(model.eval(), ids))


def test_the_wiring_head_is_in_the_versions_meta() -> None:
    """What the learner's setup publishes from (``model_args`` after ``attach_eagle_head``)
    describes the head it attached."""
    model = random_model(16, num_hidden_layers=6)
    attach_eagle_head(model, SpecConfig(method="eagle3"), None)
    args = model_args(model)
    assert args.eagle_aux_layers == (2, 3) and args.eagle_vocab_size == 0
    config = args.to_hf_config()
    assert config["eagle_aux_layers"] == [2, 3]
    rebuilt = ModelArgs.from_hf_config(config)
    assert rebuilt.eagle_aux_layers == (2, 3) and rebuilt.cache_layers == 7


def test_actors_refuse_eagle3_on_a_foreign_layout() -> None:
    hf = random_hf_model("phi3", 97)
    layout = layout_from_hf_config({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    with pytest.raises(ValueError, match="spec=eagle3 drafts with .* EAGLE-3 head"):
        check_rollout_support(layout, "vllm", "eagle3", False)
    check_rollout_support(random_model(97).args, "torch", "eagle3", False)
