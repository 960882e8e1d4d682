"""Every relative link in README.md and docs/*.md points at a file or folder that exists, and every
``#anchor`` at a heading of the page it names (GitHub's heading slugs)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than ``-`` and
    ``_`` removed, each space a hyphen."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors GitHub gives ``page``'s headings (``-1``, ``-2``… on repeats) and its HTML ids."""
    seen: dict[str, int] = {}
    out = set()
    lines = prose_lines(page.read_text(encoding="utf-8"))
    for line in lines:
        out.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(page: Path) -> list[str]:
    """The link targets in ``page``'s prose (inline code and code blocks left out)."""
    lines = [INLINE_CODE.sub("", line) for line in prose_lines(page.read_text(encoding="utf-8"))]
    text = "\n".join(lines)
    return LINK.findall(text) + REFERENCE.findall(text)


def broken(page: Path) -> list[str]:
    """Each relative link of ``page`` that does not resolve, with the reason."""
    out = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto: …
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            out.append(f"{target}: {_shown(dest)} does not exist")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            out.append(f"{target}: no heading #{anchor} in {_shown(dest)}")
    return out


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def test_slugs_follow_github() -> None:
    assert slug("Rollout speed per drafting method") == "rollout-speed-per-drafting-method"
    assert slug("Faults (chaos)") == "faults-chaos"
    assert slug("Asynchronous against synchronous RL") == "asynchronous-against-synchronous-rl"
    assert (
        slug("The `spec=hybrid` drafter: n-gram, then exit")
        == "the-spechybrid-drafter-n-gram-then-exit"
    )
    assert slug("6.7 Weights group") == "67-weights-group"


def test_the_checker_finds_a_dead_link_and_a_dead_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-section) [ok](other.md#a-section-1) [ok](#here) [web](https://x.y)\n"
        "# Here\n[gone](missing.md) [no anchor](other.md#nothing)\n"
        "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n"
    )
    assert [b.split(":")[0] for b in broken(page)] == ["missing.md", "other.md#nothing"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert links(page) or page.name != "README.md"  # the parser found README's links
    assert not broken(page), "\n".join(broken(page))
