"""Rooms of a readable size (docs/design.md §1.3): no module over 600 lines and no function over
80 lines outside tests/, and no import left below code with ruff's E402 silenced, anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
SOURCES = ("actors", "learner", "common", "ops", "benchmarks", "testing", "scripts")


def sources() -> list[Path]:
    return sorted(f for top in SOURCES for f in (ROOT / top).rglob("*.py"))


def long_functions(path: Path, limit: int) -> list[str]:
    """``name:line (n lines)`` for every function or method of ``path`` longer than ``limit``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{node.name}:{node.lineno} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_module_is_over_the_limit() -> None:
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in sources()}
    assert len(sizes) > 100
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, over


def test_no_function_is_over_the_limit() -> None:
    over = {
        str(f.relative_to(ROOT)): found
        for f in sources()
        if (found := long_functions(f, MAX_FUNCTION_LINES))
    }
    assert not over, over


def test_the_function_check_sees_a_long_one(tmp_path: Path) -> None:
    lines = ["class A:", "    def f(self):"]
    lines += [f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES)]
    planted = tmp_path / "planted.py"
    planted.write_text("\n".join(lines) + "\n")
    assert long_functions(planted, MAX_FUNCTION_LINES) == [f"f:2 ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(planted, MAX_FUNCTION_LINES + 1) == []


@pytest.mark.parametrize("top", [*SOURCES, "tests"])
def test_no_import_sits_below_code(top: str) -> None:
    marker = "noqa: " + "E402"  # spelled in two parts so this file does not match itself
    found = [
        str(f.relative_to(ROOT)) for f in (ROOT / top).rglob("*.py") if marker in f.read_text()
    ]
    assert not found, found
