"""actors and learner import common, never each other; common imports neither (DESIGN §1)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"actors": {"learner"}, "learner": {"actors"}, "common": {"actors", "learner"}}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_forbidden(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    offenders = {
        str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & FORBIDDEN[package]) for f in files
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package} must not import {FORBIDDEN[package]}: {offenders}"


def test_checker_sees_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import learner.loop\nfrom actors.sender import GroupSender\n")
    assert imported_top_levels(bad) >= {"learner", "actors"}
