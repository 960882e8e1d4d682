"""Imports go down the layers of docs/design.md §1.2: operator → sides → shared contracts.

The one layer checker: actors and learner never import each other; nothing in common/ imports a
side; a side must not import the operator layer, ops/ (launcher, reports, embedded Redis...), and
a shared contract imports neither it nor a side; no layer imports testing/, benchmarks/ or
tests/; each end of a boundary-crossing concern stays on its side. The check and the diagram in docs/design.md come from one script,
``scripts/package_diagram.py``; the diagram there must be the one the imports give today.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testing.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "package_diagram.py"

pd = load_script("package_diagram")


def test_imports_follow_the_layers():
    problems = pd.check(pd.import_graph())
    assert not problems, "\n".join(problems)


def test_script_check_exits_zero():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_every_module_has_its_folders_layer():
    """The layer is the folder: ops/ is the operator layer, common/ the shared one."""
    graph = pd.import_graph()
    assert {pd.layer_of(m) for m in graph} == {"operator", "actors", "learner", "shared"}
    assert all(pd.layer_of(m) == "operator" for m in graph if m.startswith("ops."))
    assert all(pd.layer_of(m) == "shared" for m in graph if m.startswith("common."))


def test_checker_catches_upward_and_sideways_imports():
    graph = {
        "ops.cli": {"common.link.protocol", "actors.loop"},  # operator -> anything: fine
        "actors.loop": {"common.link.protocol", "ops.launcher", "learner.loss"},
        "learner.loss": {"common.sampling"},
        "common.link.protocol": {"ops.report", "learner.loss"},
        "ops.report": set(),
        "common.sampling": set(),
        "ops.launcher": set(),
    }
    found = {(s, d) for s, d, _ in pd.violations(graph)}
    assert found == {
        ("actors.loop", "ops.launcher"),  # a side imports the operator layer
        ("actors.loop", "learner.loss"),  # sideways
        ("common.link.protocol", "ops.report"),  # shared imports operator
        ("common.link.protocol", "learner.loss"),  # shared imports a side
    }
    # A known violation that disappeared is reported too, so the list cannot go stale.
    known = {("actors.loop", "ops.launcher"): "planted"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pd, "KNOWN_VIOLATIONS", known)
        assert any("no longer imported" in p for p in pd.check({"common.sampling": set()}))
        assert not pd.check({"actors.loop": {"ops.launcher"}, "ops.launcher": set()})


def test_checker_catches_production_code_importing_test_code():
    graph = {"actors.loop": {"testing", "common.sampling"}, "common.sampling": {"benchmarks"}}
    found = {(s, d) for s, d, _ in pd.violations(graph)}
    assert found == {("actors.loop", "testing"), ("common.sampling", "benchmarks")}


def test_the_graph_sees_an_import_of_test_code(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("import os\nfrom testing.models import tiny_model\nimport benchmarks.cli\n")
    assert pd.top_level_imports(planted) == {"os", "testing", "benchmarks"}


def test_checker_keeps_each_end_of_a_concern_on_its_side():
    graph = {
        "actors.loop": {"common.weights.fetch.reader", "common.weights.publish.writer"},
        "learner.loop": {"common.link.receive.intake", "common.link.send.sender"},
        "common.weights.fetch.reader": {"common.weights.store", "common.weights.publish.writer"},
        "common.weights.publish.writer": {"common.weights.store"},
        "common.weights.store": {"common.weights.fetch.reader"},
        "common.link.receive.intake": {"common.link.protocol"},
        "common.link.send.sender": {"common.link.protocol"},
        "common.link.protocol": set(),
    }
    found = {(s, d) for s, d, _ in pd.violations(graph)}
    assert found == {
        ("actors.loop", "common.weights.publish.writer"),  # an actor loads the learner's end
        ("learner.loop", "common.link.send.sender"),  # the learner loads the actor's end
        ("common.weights.fetch.reader", "common.weights.publish.writer"),  # end to end
        ("common.weights.store", "common.weights.fetch.reader"),  # the contract imports an end
    }


def test_an_actor_process_loads_no_learner_code():
    """What `specrl-actor` imports to start: nothing of learner/ and neither learner's end."""
    code = (
        "import sys, actors.main, actors.loop\n"
        "bad = [m for m in sys.modules if m.startswith(('learner', 'common.weights.publish',"
        " 'common.link.receive'))]\n"
        "print(bad)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_import_resolution(tmp_path):
    (tmp_path / "common").mkdir()
    mod = tmp_path / "common" / "x.py"
    mod.write_text(
        "import common.model\n"
        "from common import tasks\n"
        "from common.weights import WeightStore\n"
        "def f():\n    from common.warm_start import ensure_model\n"
    )
    modules = {"common.model", "common.tasks", "common.weights", "common.warm_start", "common"}
    assert pd.project_imports(mod, modules) == modules


def test_design_doc_holds_the_current_diagram():
    doc = (ROOT / "docs" / "design.md").read_text()
    begin, end = doc.index(pd.BEGIN) + len(pd.BEGIN), doc.index(pd.END)
    expected = f"\n```mermaid\n{pd.mermaid(pd.import_graph())}\n```\n"
    assert doc[begin:end] == expected, "run: python scripts/package_diagram.py --write"
