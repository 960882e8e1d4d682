"""The launcher preloads Intel OpenMP + tcmalloc into vLLM actors on CPU, and only there."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from ops import launcher


def fake_libs(tmp_path: Path) -> tuple[Path, Path]:
    prefix, system = tmp_path / "venv", tmp_path / "usr-lib"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libiomp5.so").touch()
    (system / "x86_64-linux-gnu").mkdir(parents=True)
    (system / "x86_64-linux-gnu" / "libtcmalloc_minimal.so.4").touch()
    return prefix, system


def test_preload_names_both_libraries_when_installed(tmp_path: Path) -> None:
    prefix, system = fake_libs(tmp_path)
    got = launcher.cpu_vllm_preload(str(prefix), system)
    assert got.split(":") == [
        str(prefix / "lib" / "libiomp5.so"),
        str(system / "x86_64-linux-gnu" / "libtcmalloc_minimal.so.4"),
    ]
    (prefix / "lib" / "libiomp5.so").unlink()
    assert launcher.cpu_vllm_preload(str(prefix), system) == ""  # one missing: no preload


def test_only_vllm_actors_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix, system = fake_libs(tmp_path)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    real = launcher.cpu_vllm_preload
    monkeypatch.setattr(launcher, "cpu_vllm_preload", lambda: real(str(prefix), system))
    vllm_env = launcher._actor_env(load_config(["engine=vllm", "spec=none"]))
    assert vllm_env == {"LD_PRELOAD": real(str(prefix), system)}
    assert launcher._actor_env(load_config([])) == {}  # torch engine
    monkeypatch.setenv("LD_PRELOAD", "/some/lib.so")  # the user's own choice wins
    assert launcher._actor_env(load_config(["engine=vllm", "spec=none"])) == {}
