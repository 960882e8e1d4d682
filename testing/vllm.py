"""Helpers for the vLLM tier (``tests/engine_vllm``): small random checkpoints, greedy vLLM
engines on them, and their outputs as token lists. Imports vLLM: only that tier imports this."""

from __future__ import annotations

from actors.engines.vllm.engine import VllmEngine
from common.config.actor import EngineConfig
from common.model import Transformer
from testing.lossless_check import NO_EOS
from testing.models import random_model

EOS = 2
"""The EOS id of :func:`weights` and the default of :func:`greedy_vllm`."""
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 11, 12, 13, 14]]


def weights(seed: int) -> Transformer:
    """A random model of vocabulary 64 (BOS 1, EOS ``EOS``, pad 0), weights from ``seed``."""
    return random_model(64, seed, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)


def tokens(out) -> list[list[int]]:
    """Every rollout's tokens of an engine's ``generate`` output, group after group."""
    return [r.token_ids.tolist() for g in out for r in g]


def vllm_engine(path, eos_id: int, engine: dict, spec=None, **kwargs) -> VllmEngine:
    """A vLLM engine (in-flight mode ``keep``) on the checkpoint at ``path``; ``engine``:
    ``EngineConfig`` fields; ``kwargs``: its temperature, top_p, seed, version."""
    return VllmEngine(path, eos_id, EngineConfig(**engine), spec=spec, inflight="keep", **kwargs)


def greedy_vllm(path, version: int = 0, eos_id: int = EOS, spec=None, **engine) -> VllmEngine:
    """A greedy :func:`vllm_engine` on the checkpoint at ``path``; ``engine``: ``EngineConfig``
    fields (``vllm_max_model_len`` 64 unless given)."""
    engine.setdefault("vllm_max_model_len", 64)
    return vllm_engine(path, eos_id, engine, spec, temperature=0.0, seed=0, version=version)


def enumerable_vllm(path, spec, seed: int, **kwargs) -> VllmEngine:
    """A sampling :func:`vllm_engine` (contexts up to 32 tokens, no EOS) on the enumerable model
    at ``path``, drafting with ``spec``; ``kwargs``: its temperature, top_p, version."""
    return vllm_engine(path, NO_EOS, {"vllm_max_model_len": 32}, spec, seed=seed, **kwargs)
