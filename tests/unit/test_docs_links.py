"""Every relative link in README.md and docs/*.md resolves: the file it names exists, and an
``#anchor`` matches a heading of the target as GitHub slugs it.

External links (``https:``, ``mailto:``) are not followed: a test of this kind must not
need the network. Links inside code (fenced blocks, inline backticks) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) or ![alt](target), the target up to a space (a title may follow) or ")".
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target, a reference definition.
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def links_of(text: str) -> list[str]:
    """Every link target of a Markdown page, outside code."""
    lines = prose_lines(text)
    targets = [m.group(1) for m in map(REFERENCE.match, lines) if m]
    # A link's text may wrap onto the next line, so look at the prose as a whole.
    targets.extend(LINK.findall(INLINE_CODE.sub("", "\n".join(lines))))
    return targets


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than
    '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """Every heading anchor of a page, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for line in prose_lines(text):
        m = HEADING.match(line)
        if m is None:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of ``page``, paths relative to ``root``."""
    broken: list[str] = []
    for target in links_of(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(root)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_github_slugs_as_github_makes_them() -> None:
    assert slug("Tiers: several destinations") == "tiers-several-destinations"
    assert slug("`ckptd exec`, per trainer") == "ckptd-exec-per-trainer"
    assert slug("The trainer's word instead of a quiet window") == (
        "the-trainers-word-instead-of-a-quiet-window"
    )
    assert slug("Guarantees, and the tests that prove them") == (
        "guarantees-and-the-tests-that-prove-them"
    )
    assert slug("`file://` on the same disk") == "file-on-the-same-disk"
    assert anchors_of("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    # The rule is only worth its name if it can fail.
    (tmp_path / "there.md").write_text("# Here it is\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#here-it-is) [gone](missing.md) [bad](there.md#elsewhere)\n"
        "[a text that\nwraps](wrapped.md)\n"
        "`[code](missing.md)` [web](https://example.com/x)\n```\n[fenced](missing.md)\n```\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "missing.md: no file missing.md",
        "there.md#elsewhere: no heading #elsewhere in there.md",
        "wrapped.md: no file wrapped.md",
    ]
