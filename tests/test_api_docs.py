"""The API reference (issue 49): `mkdocs build --strict` builds it from the docstrings, and fails on
a docstring that refers to no object of the package, on a link that goes nowhere, or on a docstring
griffe cannot read."""

import importlib
import importlib.util
import logging
import subprocess
import sys
import textwrap
import zlib

import griffe
import pytest
from docs_pages import DOCS, ROOT, broken_links


def reference_module():
    spec = importlib.util.spec_from_file_location("api_reference", DOCS / "api" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_api_reference_builds_strictly(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probes = (site / "api" / "probes" / "index.html").read_text(encoding="utf-8")
    assert "probe_absolute_index" in probes and ":func:" not in probes, "rendered, roles shown as code"
    assert "remove_batch_dim" in (site / "api" / "models" / "index.html").read_text(encoding="utf-8")
    assert (site / "schema" / "index.html").is_file(), "the table schema is part of the reference"
    inventory = _inventory(site / "objects.inv")
    for package in ("nopelens.models", "nopelens.probes", "nopelens.circuits"):
        for name in importlib.import_module(package).__all__:  # a function named as its module was left out
            documented = [
                key
                for key, role in inventory.items()
                if key.startswith(package + ".") and key.rsplit(".", 1)[1] == name
            ]
            assert any(inventory[key] != "py:module" for key in documented), f"{package}.{name} is not in the reference"


def _inventory(path) -> dict[str, str]:
    """objects.inv (Sphinx's inventory format, version 2): object name -> its role."""
    lines = zlib.decompress(path.read_bytes().split(b"\n", 4)[4]).decode().splitlines()
    return {line.split(" ")[0]: line.split(" ")[1] for line in lines}


def test_the_reference_pages_links_resolve():
    pages = sorted(f"docs/api/{page.name}" for page in (DOCS / "api").glob("*.md"))
    assert pages and all(broken_links(page) == [] for page in pages)


def test_a_docstring_reference_to_no_object_fails_the_build(tmp_path, caplog):
    """The docstrings cross-refer Sphinx-style (:func:`...`), which mkdocstrings shows as text: the
    extension checks each target, so a reference left behind by a rename fails the strict build."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent('''
        import json

        def good():
            """See :func:`other`, :func:`~pkg.Thing.run`, :meth:`Thing.run`, :func:`json.loads`, :class:`torch.Tensor`.

            Example:
                >>> [1, 2]
                [1, 2]
            """

        def bad():
            """See :func:`renamed_away` and :class:`~pkg.Thing.gone`."""

        def other():
            pass

        class Thing:
            def run(self):
                pass
    ''')
    )
    extension = reference_module().DocstringConventions()
    with caplog.at_level(logging.WARNING):
        loaded = griffe.load("pkg", search_paths=[tmp_path], extensions=griffe.load_extensions(extension))
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all("pkg.bad refers to" in w for w in warnings), warnings
    assert "'renamed_away'" in warnings[0] and "'pkg.Thing.gone'" in warnings[1]
    sections = loaded["good"].docstring.parse("google")
    assert sections[-1].kind.value == "examples", "an Example: section is read as doctests"
    assert "`other`" in sections[0].value and ":func:" not in sections[0].value
