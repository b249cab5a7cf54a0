"""docs/schema.md describes every column (and the values of the listed columns) of every table a run
writes. The tests of each command call :func:`assert_documented` on what it wrote, so a new column
without its line in the doc fails the suite."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from nopelens.analyses import report
from nopelens.analyses.sweep import reads
from nopelens.probes.metrics import HIGHER_IS_BETTER

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "schema.md"

LISTED = (
    "target",
    "task",
    "features",
    "probe",
    "split",
    "metric",
    "condition",
    "status",
    "curve",
    "intervention",
    "method",
    "subject",
    "comparison",
)
"""Columns whose every value the doc lists (as `value`)."""

PLACEHOLDERS = {
    "read": lambda: [re.escape(c) for c in reads.read_columns()],
    "prefix": lambda: [re.escape(c.rsplit("_", 1)[0]) for c in reads.read_columns()],
    "metric": lambda: [re.escape(m) for m in HIGHER_IS_BETTER],
    "number": lambda: [re.escape(c) for c in report.NUMBER_HEADERS],
}
"""What a ``<name>`` in a documented column name may stand for (from the code's own lists)."""

SECTION = re.compile(r"^### (.+)$", re.M)
ROW = re.compile(r"^\| ([^|]*`[^|]*) \| (.*) \|$", re.M)
REFERENCE = re.compile(r"as in (?:the (\w+)'s )?([\w.<>]+\.csv)")


def documented() -> dict[str, dict[str, str]]:
    """Section title (``sweep: probes.csv``) -> {column name or pattern: its meaning}."""
    text = DOC.read_text(encoding="utf-8")
    heads = list(SECTION.finditer(text))
    sections = {}
    for head, following in zip(heads, heads[1:] + [None]):
        body = text[head.end() : following.start() if following else len(text)]
        columns = {}
        for names, meaning in ROW.findall(body):
            for name in re.findall(r"`([^`]+)`", names):
                columns[name] = meaning
        sections[head.group(1).strip()] = columns
    return sections


def _pattern(name: str) -> re.Pattern:
    parts = re.split(r"<(\w+)>", name)
    regex = "".join(
        re.escape(part) if i % 2 == 0 else f"({'|'.join(PLACEHOLDERS[part]())})" for i, part in enumerate(parts)
    )
    return re.compile(f"^{regex}$")


def meaning(section: str, column: str, sections: dict | None = None) -> str | None:
    """The doc's text for ``column`` of ``section`` (None if it is not documented)."""
    sections = sections or documented()
    for name, text in sections[section].items():
        if _pattern(name).match(column):
            return text
    return None


def _values_documented(section: str, column: str, values, sections: dict) -> list:
    text = meaning(section, column, sections) or ""
    missing = [v for v in values if f"`{v}`" not in text]
    reference = REFERENCE.search(text)
    if missing and reference:
        kind = reference.group(1) or section.split(":")[0]
        other = f"{kind}: {reference.group(2)}"
        if other in sections and other != section:
            return _values_documented(other, column, missing, sections)
    return missing


def assert_documented(table: pd.DataFrame | str | Path, section: str) -> None:
    """Every column of ``table`` (or the CSV at that path) is described in ``section`` of
    docs/schema.md, and every value of a :data:`LISTED` column is named there."""
    if not isinstance(table, pd.DataFrame):
        table = pd.read_csv(table)
    sections = documented()
    assert section in sections, f"docs/schema.md has no section '### {section}'"
    undocumented = [c for c in table.columns if meaning(section, c, sections) is None]
    assert not undocumented, f"columns of {section} missing from docs/schema.md: {undocumented}"
    for column in (c for c in LISTED if c in table.columns):
        values = sorted(table[column].dropna().astype(str).unique())
        missing = _values_documented(section, column, values, sections)
        assert not missing, f"values of {section} column {column!r} missing from docs/schema.md: {missing}"


def assert_folder_documented(folder: Path, kind: str) -> list[str]:
    """Every CSV in ``folder`` and its ``parts/*/`` is documented under ``kind: <file name>``.

    Returns:
        The file names checked.
    """
    paths = sorted(folder.glob("*.csv")) + sorted(folder.glob("parts/*/*.csv"))
    assert paths, f"no tables in {folder}"
    for path in paths:
        assert_documented(path, f"{kind}: {path.name}")
    return sorted({path.name for path in paths})
