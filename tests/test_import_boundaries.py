"""actors and learner import common, never each other nor ops; common imports none of them;
nothing in production imports testing/, benchmarks/ or tests/ (docs/design.md §1.2)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Helpers for tests and benchmarks (testing/) and the benchmarks themselves are never imported
# by what runs in production.
NOT_PRODUCTION = {"testing", "benchmarks", "tests"}
FORBIDDEN = {
    "actors": {"learner", "ops"} | NOT_PRODUCTION,
    "learner": {"actors", "ops"} | NOT_PRODUCTION,
    "common": {"actors", "learner", "ops"} | NOT_PRODUCTION,
    "ops": NOT_PRODUCTION,
}


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
    bad.write_text("import learner.loop\nfrom actors.loop import run\n")
    assert imported_top_levels(bad) >= {"learner", "actors"}


UNSAFE_DESERIALIZERS = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def test_no_pickle_anywhere():
    """Nothing on the wire, in Redis or in checkpoints is unpickled: msgpack, JSON, safetensors."""
    files = [
        f
        for package in ("actors", "learner", "common", "benchmarks")
        for f in (ROOT / package).rglob("*.py")
    ]
    offenders = {
        str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & UNSAFE_DESERIALIZERS)
        for f in files
    }
    assert not {k: v for k, v in offenders.items() if v}
    # torch.load unpickles unless weights_only=True; the project never calls it.
    assert not [f for f in files if _calls_torch_load(f)]


def _calls_torch_load(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        func = getattr(node, "func", None)
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "load"
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
        ):
            return True
    return False


def test_torch_load_checker(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nsd = torch.load('x.pt')\n")
    good = tmp_path / "good.py"
    good.write_text("import safetensors.torch\nsd = safetensors.torch.load(b'')\n")
    assert _calls_torch_load(bad) and not _calls_torch_load(good)


def test_every_listener_defaults_to_loopback():
    from common.config import SpecRLConfig

    cfg = SpecRLConfig()
    assert cfg.learner.resolved_bind().startswith("tcp://127.0.0.1:")
    assert cfg.security.metrics_host == "127.0.0.1"
    from ops.redis_server import RedisServer

    assert RedisServer.__init__.__defaults__ is not None
    assert "127.0.0.1" in RedisServer.__init__.__defaults__  # the private Redis's bind
