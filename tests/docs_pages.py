"""Reading the prose pages (README.md, docs/*.md) for their tests: fenced blocks, the `nopelens`
commands in them, and relative links with their anchors."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def text(page: str) -> str:
    """A page by its path from the repository root (``README.md``, ``docs/probing.md``)."""
    return (ROOT / page).read_text(encoding="utf-8")


def blocks(page: str, language: str) -> list[str]:
    """The fenced blocks of ``language`` (``python``, ``bash``, ``text``, ``yaml``), in page order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text(page), re.S | re.M)


def block_after(page: str, heading: str, language: str = "python") -> str:
    """The first ``language`` block after ``heading`` (a line of the page)."""
    page_text = text(page)
    section = page_text[page_text.index(heading) :]
    return re.search(rf"^```{language}\n(.*?)^```", section, re.S | re.M).group(1)


def commands(page: str) -> list[list[str]]:
    """Every ``nopelens ...`` command of the page's bash blocks and ``$ nopelens`` lines of its text
    blocks, as argv lists without the program name (a trailing ``# comment`` dropped)."""
    lines = [line for block in blocks(page, "bash") for line in block.splitlines()]
    lines += [line[2:] for block in blocks(page, "text") for line in block.splitlines() if line.startswith("$ ")]
    found = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if words[:1] == ["nopelens"]:
            found.append(words[1:])
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    content = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(line.lstrip("#")) for line in content.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(page: str) -> list[str]:
    """Relative links of ``page`` whose file does not exist or whose ``#anchor`` is no heading there."""
    source = ROOT / page
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(target)
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(target)
    return broken
