"""The README and the docs pages link to each other's sections and to their raw data. A link whose file or
section is gone is a broken promise to a reader, so every relative link must resolve: the file exists, and an
anchor names a heading of that page as GitHub spells it."""
from __future__ import annotations

import functools
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    kept = "".join(c for c in text if unicodedata.category(c)[0] in "LNM" or c in "_- ")
    return kept.replace(" ", "-")


@functools.cache  # a page is linked many times (README → decode.md dozens): read it once
def page_anchors(page: Path) -> frozenset[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.*)", line)
        if match:
            anchor = github_anchor(match.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return frozenset(anchors)


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text(encoding="utf-8"))
            if not target.startswith(("http://", "https://", "mailto:"))]


def test_anchor_spelling() -> None:
    assert github_anchor("The query/key programs first in the launch's code (fifty-ninth session)") == \
        "the-querykey-programs-first-in-the-launchs-code-fifty-ninth-session"
    assert github_anchor("`oscarkv bench decode`") == "oscarkv-bench-decode"
    assert github_anchor("Decode at batch 1: the bytes stream at 86%, a fixed 13 µs does not") == \
        "decode-at-batch-1-the-bytes-stream-at-86-a-fixed-13-µs-does-not"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part) if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in page_anchors(linked):
            broken.append(f"{target}: no such section")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_leads_with_the_two_commands() -> None:
    """A reader on a fresh machine finds the install and the two commands (the demo and the tests) first."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.*)$", readme, flags=re.MULTILINE)
    assert headings[0] == "Quick start"
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "oscarkv demo" in quick and "\npytest" in quick
