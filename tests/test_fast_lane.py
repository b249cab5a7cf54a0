"""The fast lane, ``python -m pytest -m "not slow"``, still reaches every module of models/, circuits/,
probes/ and analyses/: each one is reached by a test file with at least one test outside the slow lane.

A file reaches a module when it imports it or a name of it (a name that a package re-exports, imported or
read as ``package.name``, counts for the module that defines it; the test helpers the file imports and
conftest.py count as part of it), when it names one of ``nopelens``'s commands or one of the position
methods as a string (the CLI and ``get_method`` import by those names), or when a module it reaches
imports it at run time. A package's ``__init__`` passes
nothing on (it imports its whole subpackage), and is reached when it or a module in it is. This is an
upper bound on the lane's reach, read from the source in a second; coverage measures the lines
(``coverage run -m pytest -m "not slow"``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import package_modules

from nopelens.analyses.cli import COMMANDS
from nopelens.models.methods import METHODS

TESTS = Path(__file__).parent
PACKAGES = ("nopelens.models", "nopelens.circuits", "nopelens.probes", "nopelens.analyses")


def _is_slow(node: ast.expr) -> bool:
    return "mark.slow" in ast.unparse(node)


def has_fast_tests(tree: ast.Module) -> bool:
    """Whether a test file has a test the fast lane runs: one whose decorators do not mark it slow, in
    a file whose ``pytestmark`` does not (a test with only some parametrizations slow still runs)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if _is_slow(node.value):
                return False
    tests = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
    ]
    return any(not any(_is_slow(d) for d in test.decorator_list) for test in tests)


def _defining_module(package: str, name: str, known: dict) -> str:
    """``from package import name``: the module ``name`` is, or the module that defines it."""
    if f"{package}.{name}" in known:
        return f"{package}.{name}"
    defined_in = getattr(getattr(importlib.import_module(package), name, None), "__module__", None)
    return defined_in if defined_in in known else package


def _module_aliases(tree: ast.Module, known: dict) -> dict[str, str]:
    """Name -> the nopelens module it is bound to by an import (``from nopelens.analyses import intervene as iv``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known})
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            aliases.update(
                {
                    alias.asname or alias.name: f"{node.module}.{alias.name}"
                    for alias in node.names
                    if f"{node.module}.{alias.name}" in known
                }
            )
    return aliases


def named_modules(tree: ast.Module, helpers: dict[str, ast.Module]) -> set[str]:
    """The nopelens modules a test file imports or names a command or method of, with what the test
    helpers it imports name (``helpers``: module name -> its tree)."""
    known = package_modules.modules()
    found: set[str] = set()
    for alias, module in _module_aliases(tree, known).items():  # ``iv.first_real_index``: where it is defined
        found.update(
            _defining_module(module, node.attr, known)
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == alias
        )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            found.update(name for name in names if name in known)
            found.update(m for name in names if name in helpers for m in named_modules(helpers.pop(name), helpers))
        elif isinstance(node, ast.ImportFrom) and node.module in helpers:
            found |= named_modules(helpers.pop(node.module), helpers)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            found.update(_defining_module(node.module, alias.name, known) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in COMMANDS:
                found.add(COMMANDS[node.value][0])
            if node.value in METHODS:
                found.add(METHODS[node.value].__module__)
    return found


def discovered(module: str) -> set[str]:
    """The modules a registry imports by discovery: every module of each nopelens package that
    ``module`` names in a module-level ``..._PACKAGE`` string (``FAMILIES_PACKAGE`` of
    :mod:`nopelens.models.hf.family`, which imports each module of that package at run time)."""
    known = package_modules.modules()
    tree = ast.parse(known[module][0].read_text(encoding="utf-8"))
    packages = {
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "").endswith("_PACKAGE") for t in node.targets)
        and isinstance(node.value, ast.Constant)
        and node.value.value in known
    }
    return {name for name in known for package in packages if name.startswith(package + ".")}


def reached(named: set[str]) -> set[str]:
    """``named`` and what they import at run time (or discover, :func:`discovered`), a package's
    ``__init__`` passing nothing on; each package above a reached module (importing a module runs
    its package's ``__init__``)."""
    known, imports = package_modules.modules(), package_modules.imports()
    found, todo = set(named), list(named)
    while todo:
        module = todo.pop()
        if known[module][1]:
            continue
        for target in (imports[module] | discovered(module)) - found:
            found.add(target)
            todo.append(target)
    return found | {module.rsplit(".", depth)[0] for module in found for depth in range(1, module.count("."))}


def _trees(folder: Path) -> tuple[dict[str, ast.Module], dict[str, ast.Module]]:
    """(test files, helper modules) of a tests folder: file stem -> parsed source."""
    parsed = {path.stem: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.py"))}
    tests = {name: tree for name, tree in parsed.items() if name.startswith("test_")}
    return tests, {name: tree for name, tree in parsed.items() if name not in tests}


def fast_lane_reach(folder: Path) -> set[str]:
    tests, helpers = _trees(folder)
    named: set[str] = set()
    for tree in tests.values():
        if has_fast_tests(tree):
            named |= named_modules(tree, dict(helpers))
    if named and "conftest" in helpers:  # conftest.py is loaded for every test
        named |= named_modules(helpers["conftest"], dict(helpers))
    return reached(named)


def test_every_module_is_reached_by_a_test_outside_the_slow_lane():
    modules = [name for name in package_modules.modules() if name.startswith(PACKAGES)]
    assert len(modules) > 40  # the discovery found the package, not an empty folder
    missing = sorted(set(modules) - fast_lane_reach(TESTS))
    assert not missing, f"only slow tests reach {missing}: keep a cheaper test of each outside the slow lane"


def test_the_reach_rule_on_written_files(tmp_path):
    """Each route counts, and only from tests the fast lane runs."""
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "helper.py").write_text("from nopelens.models import zoo\n")
    (tmp_path / "test_a.py").write_text(
        "import helper\nfrom nopelens.models import Decoder\n"
        "def test_x():\n    main(['circuit'])\n    get_method('alibi')\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\nfrom nopelens.analyses import lengthgen\n@pytest.mark.slow\ndef test_y():\n    pass\n"
    )
    (tmp_path / "test_c.py").write_text(
        "import pytest\npytestmark = [pytest.mark.slow]\n"
        "from nopelens.analyses import validate\ndef test_z():\n    pass\n"
    )
    reach = fast_lane_reach(tmp_path)
    for module in (
        "nopelens.models.zoo",
        "nopelens.models.decoder",
        "nopelens.analyses.cli.circuit",
        "nopelens.analyses.circuit_checks",
        "nopelens.models.methods.alibi",
        "nopelens.models",
        "nopelens.analyses.cli",
    ):
        assert module in reach, module
    assert "nopelens.analyses.lengthgen" not in reach and "nopelens.analyses.validate" not in reach
    assert "nopelens.models.methods.shaw" not in reach  # the methods package imports it, and passes nothing on


def test_a_name_read_from_a_package_reaches_the_module_that_defines_it(tmp_path):
    (tmp_path / "test_a.py").write_text("import nopelens.probes as pr\ndef test_x():\n    pr.sink_table\n")
    assert "nopelens.probes.sinks" in fast_lane_reach(tmp_path)
    (tmp_path / "test_a.py").write_text("import nopelens.probes as pr\ndef test_x():\n    pr\n")
    assert "nopelens.probes.sinks" not in fast_lane_reach(tmp_path)
