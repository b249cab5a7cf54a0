"""Run the doctests of the math helpers (known values from the seeds and papers)."""

import doctest
import importlib

import pytest

MODULES = [
    "nopelens.models.positions",
    "nopelens.models.hf",
    "nopelens.models.masks",
    "nopelens.models.tasks",
    "nopelens.models.training",
    "nopelens.circuits.counter",
    "nopelens.circuits.distance",
    "nopelens.circuits.demos",
    "nopelens.analyses.audit.numerics",
    "nopelens.probes.collect",
    "nopelens.probes.metrics",
    "nopelens.probes.targets",
    "nopelens.probes.linear",
    "nopelens.probes.fitting",
    "nopelens.probes.sinks",
    "nopelens.probes.extreme_tokens",
    "nopelens.analyses.dynamics",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no doctests"
    assert result.failed == 0
