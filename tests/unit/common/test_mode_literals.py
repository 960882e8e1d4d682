"""Mode fields are ``Literal`` aliases of ``common/config/modes.py``, and every comparison of one
against a string constant, anywhere in the tree, uses a value of that field's alias: a typo such
as ``cfg.actor.inflight == "verify_on_swop"`` (always false) fails here instead of silently
taking the other branch."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from common.config import SpecRLConfig, field_types, modes

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("actors", "benchmarks", "common", "learner", "ops", "scripts", "testing", "tests")
GENERIC = {"name", "format", "method", "profile"}
"""Mode field names that other objects use too (``path.name``, ``rows[k].method``): a comparison
counts only when the object is a section (``cfg.spec.method``, ``spec.method``), ``self`` in the
section's class, or a parameter annotated with the section's class. The other mode field names
count on any object (``self.inflight`` of an engine holds ``actor.inflight``)."""


def literal_of(annotation: object) -> tuple[str, ...] | None:
    """The values of the ``modes`` alias a raw (string) field annotation names, else None."""
    alias = getattr(modes, annotation, None) if isinstance(annotation, str) else None
    return typing.get_args(alias) if typing.get_origin(alias) is typing.Literal else None


def sections() -> dict[str, tuple[type, dict[str, tuple[str, ...]]]]:
    """``{section: (its dataclass, {mode field: allowed values})}`` from the annotations."""
    out = {}
    hints = typing.get_type_hints(SpecRLConfig)
    for section in dataclasses.fields(SpecRLConfig):
        cls = hints[section.name]
        fields = {f.name: literal_of(f.type) for f in dataclasses.fields(cls)}
        out[section.name] = (cls, {k: v for k, v in fields.items() if v is not None})
    return out


SECTIONS = sections()


def string_constants(node: ast.expr) -> list[str] | None:
    """The strings of a constant or of a tuple/list/set of constants, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


class ModeComparisons(ast.NodeVisitor):
    """Collects ``(line, "section.field", constant)`` for each constant a mode field is compared
    with (``==``, ``!=``, ``in``, ``not in``)."""

    def __init__(self) -> None:
        self.by_class = {cls.__name__: name for name, (cls, _) in SECTIONS.items()}
        owners: dict[str, list[str]] = {}
        for name, (_, fields) in SECTIONS.items():
            for field in fields:
                owners.setdefault(field, []).append(name)
        self.anywhere = {f: s[0] for f, s in owners.items() if len(s) == 1 and f not in GENERIC}
        self.scopes: list[dict[str, str]] = [{}]
        self.found: list[tuple[int, str, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        section = self.by_class.get(node.name)
        self.scopes.append({"self": section} if section else {})
        self.generic_visit(node)
        self.scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        names = {}
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            for part in ast.walk(arg.annotation) if arg.annotation else ():
                text = part.id if isinstance(part, ast.Name) else getattr(part, "value", None)
                if isinstance(text, str) and text in self.by_class:
                    names[arg.arg] = self.by_class[text]
        self.scopes.append(names)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        """``lcfg = cfg.learner``: the name holds that section from here on (in this scope)."""
        target = node.targets[0] if len(node.targets) == 1 else None
        value = node.value.func if isinstance(node.value, ast.Call) else node.value
        section = (
            self.by_class.get(value.id) if isinstance(value, ast.Name) else self.section_of(value)
        )
        if isinstance(target, ast.Name) and section is not None:
            self.scopes[-1][target.id] = section
        self.generic_visit(node)

    def section_of(self, owner: ast.expr) -> str | None:
        if isinstance(owner, ast.Attribute) and owner.attr in SECTIONS:
            return owner.attr
        if isinstance(owner, ast.Name):
            if owner.id in SECTIONS:
                return owner.id
            for scope in reversed(self.scopes):
                if owner.id in scope:
                    return scope[owner.id]
        return None

    def field_of(self, node: ast.expr) -> str | None:
        if not isinstance(node, ast.Attribute):
            return None
        section = self.section_of(node.value)
        if section is not None and node.attr in SECTIONS[section][1]:
            return f"{section}.{node.attr}"
        if node.attr in self.anywhere:
            return f"{self.anywhere[node.attr]}.{node.attr}"
        return None

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
            pairs = [(left, right)]
            if isinstance(op, ast.Eq | ast.NotEq):
                pairs.append((right, left))
            elif not isinstance(op, ast.In | ast.NotIn):
                continue
            for attr, other in pairs:
                key, values = self.field_of(attr), string_constants(other)
                if key is not None and values is not None:
                    self.found.extend((node.lineno, key, value) for value in values)
        self.generic_visit(node)


def mode_comparisons(source: str) -> list[tuple[int, str, str]]:
    scan = ModeComparisons()
    scan.visit(ast.parse(source))
    return scan.found


def bad_comparisons(source: str, where: str = "<source>") -> list[str]:
    """``where:line: section.field == 'value'`` for each value outside the field's Literal."""
    return [
        f"{where}:{line}: {key} compared with {value!r}, not one of "
        f"{SECTIONS[key.split('.')[0]][1][key.split('.')[1]]}"
        for line, key, value in mode_comparisons(source)
        if value not in SECTIONS[key.split(".")[0]][1][key.split(".")[1]]
    ]


def python_files() -> list[Path]:
    return sorted(
        path
        for top in SCANNED
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def test_every_mode_field_is_a_literal_of_modes_refused_outside_it():
    typed = {f"{s}.{f}": v for s, (_, fields) in SECTIONS.items() for f, v in fields.items()}
    assert {
        "task.name",
        "task.format",
        "task.chat_template",
        "spec.method",
        "spec.ngram_sources",
        "actor.inflight",
        "engine.name",
        "engine.torch_dtype",
        "engine.vllm_draft_dtype",
        "learner.model_impl",
        "learner.precision",
        "learner.publish_dtype",
        "learner.publish_upload",
        "learner.profile",
    } <= set(typed)
    for key in typed:
        section, field = key.split(".")
        cls = SECTIONS[section][0]
        # What OmegaConf (Hydra's schema) reads: a str field; __post_init__ checks the value.
        assert typing.get_type_hints(cls)[field] is str, key
        with pytest.raises(ValueError, match=rf"{key}\b.*'no-such-mode'"):
            cls(**{field: "no-such-mode"})


def test_field_types_names_every_alias_of_modes():
    aliases = {k for k, v in vars(modes).items() if typing.get_origin(v) is typing.Literal}
    assert set(field_types.__all__) == aliases
    assert all(getattr(field_types, name) is str for name in aliases)  # what OmegaConf reads


def test_subsets_of_modes_hold_values_of_their_alias():
    assert set(modes.DATASET_TASKS) <= set(modes.TASK_NAMES)
    assert set(modes.DATASET_SUFFIXES.values()) <= set(modes.DATASET_FORMATS)
    for subset in (modes.EXIT_METHODS, modes.EAGLE_METHODS, modes.NGRAM_METHODS):
        assert set(subset) <= set(modes.SPEC_METHODS)
    assert set(modes.AUTO_SPEC_METHOD) == set(modes.ENGINE_NAMES)
    assert set(modes.AUTO_SPEC_METHOD.values()) <= set(modes.SPEC_METHODS)
    assert set(modes.VLLM_INFLIGHT_MODES) <= set(modes.INFLIGHT_MODES)


def test_the_scan_finds_planted_typos_and_passes_correct_comparisons():
    planted = """
from common.config import SpecRLConfig
from common.config.run import TaskConfig

def f(cfg: SpecRLConfig, task: "TaskConfig", rows):
    if cfg.spec.method == "eagle":  # typo: eagle3
        pass
    if self.inflight in ("abort", "verify_on_swop"):  # typo in a tuple, on any object
        pass
    if "bf16_mixed" != cfg.learner.precision:  # constant on the left
        pass
    if task.name == "word_problems" and rows[0].method == "anything" and path.name == "x":
        pass
    lcfg = cfg.learner
    return lcfg.profile == "of"  # typo: off, on a name bound to a section

class TaskConfig:
    def g(self):
        return self.format == "csv"  # self of the section's class
"""
    bad = bad_comparisons(planted)
    assert [line.split(": ", 1)[1].split(" compared")[0] for line in bad] == [
        "spec.method",
        "actor.inflight",
        "learner.precision",
        "learner.profile",
        "task.format",
    ], bad
    assert "'eagle'" in bad[0] and "'verify_on_swop'" in bad[1]
    assert len(mode_comparisons(planted)) == 7  # the correct ones were seen, and passed


def test_comparisons_with_mode_strings_use_values_of_the_field_literal():
    bad, seen = [], 0
    for path in python_files():
        source = path.read_text(encoding="utf-8")
        seen += len(mode_comparisons(source))
        bad += bad_comparisons(source, str(path.relative_to(ROOT)))
    assert not bad, "\n".join(bad)
    assert seen >= 30, seen  # the scan does see the tree's comparisons
