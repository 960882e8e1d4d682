"""Metric keys are defined once, in common/metric_names.py, and every writer and reader uses them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from common import metric_names as mn

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("actors", "learner", "common", "ops", "benchmarks", "testing")
# A whole key or a key family's start, as a string constant in code.
KEY = re.compile(
    r"^(actor|spec|verify|reward|eval|sender|learner|receiver|env)/[a-z0-9_]*(/[a-z0-9_]*)?$"
)


def key_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY.match(node.value)
    ]


def test_no_metric_key_is_spelled_outside_the_registry():
    registry = ROOT / "common" / "metric_names.py"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {value!r}"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if path != registry
        for line, value in key_literals(path)
    ]
    assert not found, "use common.metric_names instead of:\n" + "\n".join(found)


def test_the_scan_sees_a_bare_key(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('record = {"learner/loss": 1.0, f"receiver/refused/{reason}": 2}\n')
    assert [v for _, v in key_literals(bad)] == ["learner/loss", "receiver/refused/"]


def test_each_name_holds_one_distinct_key():
    names = {n: v for n, v in vars(mn).items() if n.isupper() and isinstance(v, str)}
    assert len(set(names.values())) == len(names)
    for name, value in names.items():
        assert KEY.match(value), (name, value)
        expected = re.sub(r"[^A-Za-z0-9]+", "_", value).strip("_").upper()
        assert name.removesuffix("_PREFIX").removesuffix("_GROUP") == expected, (name, value)
    assert {v for n, v in names.items() if not n.endswith(("_PREFIX", "_GROUP"))} == mn.ALL
    assert mn.ROLLOUT_GROUPS == (mn.SPEC_GROUP, mn.VERIFY_GROUP, mn.REWARD_PREFIX, mn.ENV_GROUP)


def test_is_known_takes_whole_keys_and_family_members_only():
    assert mn.is_known(mn.LEARNER_LOSS)
    assert mn.is_known(mn.RECEIVER_REFUSED_PREFIX + "stale")
    assert mn.is_known(f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}3")
    assert not mn.is_known("learner/not_a_metric")
    assert not mn.is_known("loss")
