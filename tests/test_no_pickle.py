"""No pickle: nothing on the wire, in Redis or in checkpoints is unpickled (msgpack, JSON,
safetensors), and torch.load is never called. The import layers: tests/test_package_layers.py."""

import ast
from pathlib import Path

from testing.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent

# The layer checker's reading of imports, loaded once (not once per file).
imported_top_levels = load_script("package_diagram").top_level_imports


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
