"""Run the doctests of every module of the package (math helpers carry known values from the
seeds and papers). Modules are discovered from the source tree, not listed."""

import doctest
import importlib

import pytest
from package_modules import modules

MODULES = sorted(name for name in modules() if name != "nopelens")


def test_the_math_modules_are_discovered():
    assert {
        "nopelens.models.positions",
        "nopelens.probes.metrics",
        "nopelens.analyses.audit.numerics",
        "nopelens.analyses.audit.detector",
        "nopelens.models.masks",
        "nopelens.analyses.cli.options",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_the_package_has_doctests():
    attempted = {name: doctest.testmod(importlib.import_module(name), report=False).attempted for name in MODULES}
    assert sum(attempted.values()) >= 80, "the math helpers lost their doctests"
    for name in (
        "nopelens.models.positions",
        "nopelens.models.hooks",
        "nopelens.probes.metrics",
        "nopelens.analyses.runs",
    ):
        assert attempted[name] > 0, f"{name} has no doctests"
