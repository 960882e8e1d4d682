"""vLLM's usage statistics (sent to stats.vllm.ai by its GPU worker) are off in the actor unless
the user turns them on: the actor sets ``VLLM_NO_USAGE_STATS=1`` and ``DO_NOT_TRACK=1`` before it
imports vLLM, and keeps a value the user set."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engines.vllm.setup import USAGE_STATS_OFF, import_vllm

REPO = Path(__file__).resolve().parents[3]


def test_the_variables_are_set_before_vllm_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in USAGE_STATS_OFF:
        monkeypatch.delenv(name, raising=False)
    seen: dict[str, str | None] = {}

    class Recorder:
        """Stands in for vLLM's package: records the environment at the moment it is imported."""

        def __getattr__(self, attr: str) -> object:
            seen.update({name: os.environ.get(name) for name in USAGE_STATS_OFF})
            raise ImportError("not vLLM")

    monkeypatch.setitem(sys.modules, "vllm", Recorder())
    with pytest.raises(ImportError, match="engine=vllm needs vLLM"):
        import_vllm(on_gpu=False)
    assert seen == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def test_a_value_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    monkeypatch.setenv("DO_NOT_TRACK", "0")
    monkeypatch.setitem(sys.modules, "vllm", None)  # the import fails after the settings
    with pytest.raises(ImportError):
        import_vllm(on_gpu=False)
    assert os.environ["VLLM_NO_USAGE_STATS"] == "0" and os.environ["DO_NOT_TRACK"] == "0"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_itself_reports_its_usage_statistics_off(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {*USAGE_STATS_OFF, "VLLM_DO_NOT_TRACK"}}
    env["HOME"] = str(tmp_path)  # no ~/.config/vllm/do_not_track either
    code = (
        "from actors.engines.vllm.setup import import_vllm\n"
        "import_vllm(on_gpu=False)\n"
        "from vllm.usage import usage_lib\n"
        "print('enabled', usage_lib.is_usage_stats_enabled())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "enabled False" in out.stdout
