"""The package diagram of specrl, read from the imports, and the check that they go downward.

Three layers (docs/design.md §1.2):

- **operator**: ``ops/``, what a person runs to start, plan and read runs (the CLI, the
  launcher, the embedded Redis, reports, the ledger reader, the memory plan); it may import
  anything below it;
- **sides**: ``actors/`` and ``learner/``, the two halves of the service; each imports the
  shared layer and never the other side;
- **shared**: ``common/``, the contracts both sides agree on (wire, weights,
  model, tokenizer, tasks, config, sampling) and the small infrastructure both run (metrics,
  Prometheus exporters, signal handling); it imports nothing above it.

Inside the shared layer, the two concerns that cross the process boundary each keep both ends in
one folder: the weight plane (``common/weights/``: its contract, ``publish/`` the learner's end,
``fetch/`` the actor's) and the trajectory link (``common/link/``: wire types and transport,
``send/`` the actor's end, ``receive/`` the learner's). An end never imports the other side's end,
the contract imports neither, and a side never imports the other side's end: an actor process
loads no learner code.

No layer imports ``testing/``, ``benchmarks/`` or ``tests/``.

Every ``import``/``from ... import`` in a module counts, including those inside functions (a lazy
import is still a dependency). Run ``python scripts/package_diagram.py`` to print the Mermaid
diagram, ``--check`` to print the violations and exit 1 if there is one not in
``KNOWN_VIOLATIONS`` (or a known one that no longer happens; ``--strict``: on any violation),
``--write`` to replace the diagram between the markers in docs/design.md.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ops", "common", "actors", "learner")
LAYERS = {"operator": 2, "actors": 1, "learner": 1, "shared": 0}
NOT_PRODUCTION = ("testing", "benchmarks", "tests")
"""Helpers of tests and benchmarks, the benchmarks and the tests: never imported by what runs."""
# Imports that break the layering today, each with why, until the module moves. The check fails
# on a violation not listed here and on a listed one that no longer happens.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}
# The ends of the boundary-crossing concerns, by the side whose process runs them.
ENDS = {
    "common.weights.publish": "learner",
    "common.weights.fetch": "actors",
    "common.link.receive": "learner",
    "common.link.send": "actors",
}
CONCERNS = ("common.weights", "common.link")
END_LABELS = {"learner": "the learner's end", "actors": "the actor's end"}
BEGIN = "<!-- package-diagram:begin (scripts/package_diagram.py --write) -->"
END = "<!-- package-diagram:end -->"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    top = module.split(".")[0]
    return {"ops": "operator", "common": "shared"}.get(top, top)


def end_of(module: str) -> str | None:
    """The side whose process runs ``module``'s end of a concern (None: not in an end)."""
    for prefix, side in ENDS.items():
        if module == prefix or module.startswith(prefix + "."):
            return side
    return None


def concern_of(module: str) -> str | None:
    return next((c for c in CONCERNS if module == c or module.startswith(c + ".")), None)


def top_level_imports(path: Path) -> set[str]:
    """The top-level names ``path`` imports (``import a.b`` and ``from a.b import c``: ``a``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import mod`` resolves to ``pkg.mod``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            # The longest project module that the name starts with: a.b.func -> a.b.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in PACKAGES:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}
    modules = set(files)
    graph = {m: project_imports(f, modules) - {m} for m, f in files.items()}
    for m, f in files.items():  # what runs in production never imports test or benchmark code
        graph[m] |= {name for name in top_level_imports(f) if name in NOT_PRODUCTION}
    # A package's __init__ is imported on the way to its modules; it is not a dependency edge.
    return {m: {t for t in targets if t not in PACKAGES} for m, targets in graph.items()}


def violations(graph: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    """(importer, imported, what is wrong) for every import that does not go downward."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if dst in NOT_PRODUCTION:
                bad.append((src, dst, f"production code imports {dst}/"))
                continue
            a, b = layer_of(src), layer_of(dst)
            if LAYERS[a] < LAYERS[b]:
                bad.append((src, dst, f"upward: {a} imports {b}"))
            elif LAYERS[a] == LAYERS[b] == 1 and a != b:
                bad.append((src, dst, f"sideways: {a} imports {b}"))
            elif (end := end_of(dst)) and (mine := end_of(src) or a) in ("actors", "learner"):
                if mine != end:
                    bad.append((src, dst, f"across the boundary: {mine} code imports {end}'s end"))
            elif end and concern_of(src) and not end_of(src):
                bad.append((src, dst, "a concern's contract imports one of its ends"))
    return bad


def mermaid(graph: dict[str, set[str]]) -> str:
    """Each side as one node, the ``common/`` modules of the other two layers one by one.

    An arrow is "some module of this side (or this operator module) imports that module".
    Arrows inside a layer are left out: the layers say what may depend on what, so every arrow
    points down the page, except a violation, drawn dotted from the module that commits it.
    """
    graph = {m: targets - set(NOT_PRODUCTION) for m, targets in graph.items()}
    node = {m: m.replace(".", "_") for m in graph}
    for side in ("actors", "learner"):
        node.update({m: side for m in graph if m.split(".")[0] == side})
    for prefix in ENDS:  # a concern's end is one node
        node.update(
            {m: prefix.replace(".", "_") for m in graph if end_of(m) and m.startswith(prefix)}
        )
    lines = ["flowchart TB"]
    titles = {"operator": "operator layer (ops/)", "shared": "shared layer (common/)"}
    for layer in ("operator", "sides", "shared"):
        if layer == "sides":
            lines += [
                '  subgraph sides["the two sides: never import each other"]',
                "    direction LR",
                '    actors["actors/"]',
                '    learner["learner/"]',
                "  end",
            ]
            continue
        lines.append(f'  subgraph {layer}["{titles[layer]}"]')
        named: dict[str, str] = {}
        for m in sorted(m for m in graph if layer_of(m) == layer and m not in PACKAGES):
            if m in CONCERNS and not graph[m]:
                continue  # an empty package file: the folder, not a module
            end = next((e for e in ENDS if m == e or m.startswith(e + ".")), None)
            named.setdefault(
                node[m],
                f"{end.split('.', 1)[1].replace('.', '/')}/ ({END_LABELS[ENDS[end]]})"
                if end
                else m.split(".", 1)[1],
            )
        lines += [f'    {n}["{label}"]' for n, label in named.items()]
        lines.append("  end")
    edges: set[tuple[str, str, str]] = set()
    for src, targets in graph.items():
        for dst in targets:
            if layer_of(src) == layer_of(dst) and not (end_of(src) or end_of(dst)):
                continue
            if node[src] == node[dst] or (
                layer_of(src) == layer_of(dst) and layer_of(src) != "shared"
            ):
                continue
            # A violation keeps its importing module in the label.
            label = f"violation: {src}" if (src, dst) in KNOWN_VIOLATIONS else ""
            edges.add((node[src], node[dst], label))
    # Solid arrows first (they set the layout), violations last.
    for src, dst, label in sorted(edges, key=lambda e: (bool(e[2]), e[0], e[1])):
        arrow = f"-.->|{label}|" if label else "-->"
        lines.append(f"  {src} {arrow} {dst}")
    return "\n".join(lines)


def check(graph: dict[str, set[str]]) -> list[str]:
    """Problems: violations not in KNOWN_VIOLATIONS, and known ones that no longer happen."""
    found = violations(graph)
    problems = [f"{s} -> {d} ({why})" for s, d, why in found if (s, d) not in KNOWN_VIOLATIONS]
    seen = {(s, d) for s, d, _ in found}
    problems += [
        f"{s} -> {d} is listed in KNOWN_VIOLATIONS but no longer imported: remove it"
        for s, d in KNOWN_VIOLATIONS
        if (s, d) not in seen
    ]
    return problems


def write(doc: Path, diagram: str) -> None:
    text = doc.read_text()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{doc}: markers {BEGIN!r} ... {END!r} not found")
    doc.write_text(f"{head}{BEGIN}\n```mermaid\n{diagram}\n```\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a layering violation")
    parser.add_argument("--write", action="store_true", help="update docs/design.md in place")
    parser.add_argument(
        "--strict", action="store_true", help="with --check: known violations fail too"
    )
    args = parser.parse_args(argv)
    graph = import_graph()
    diagram = mermaid(graph)
    if args.write:
        write(ROOT / "docs" / "design.md", diagram)
    elif not args.check:
        print(diagram)
    for src, dst, why in violations(graph):
        note = KNOWN_VIOLATIONS.get((src, dst))
        print(f"{'known' if note else 'NEW'} violation: {src} -> {dst} ({why})", file=sys.stderr)
    problems = check(graph)
    if args.strict:
        problems += [
            f"{s} -> {d} ({why})" for s, d, why in violations(graph) if (s, d) in KNOWN_VIOLATIONS
        ]
    for problem in problems:
        print(f"layering: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
