"""The repository's scripts/: the *.py ones loaded as modules by the tests that check them
(scripts/ is not a package), the shell ones run as a person runs them."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a fresh module named ``name`` (not put in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``bash scripts/<name> ARGS`` in the repository root, its output captured as text."""
    return subprocess.run(
        ["bash", f"scripts/{name}", *args],
        cwd=SCRIPTS.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_refused(name: str, out: Path, reason: str, timeout: float) -> None:
    """``scripts/<name> --json OUT`` on a machine without the GPUs it needs: it exits 2, says
    ``reason`` and points at ``--cpu`` on stderr, and writes no JSON."""
    proc = run_script(name, "--json", str(out), timeout=timeout)
    assert proc.returncode == 2, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert reason in proc.stderr and "--cpu" in proc.stderr
    assert not out.exists()
