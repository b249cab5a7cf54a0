"""Names that moved in issue 39's reorganisation still import, with a one-line deprecation naming
their new home; names that went say what to use instead."""

import dataclasses
import importlib

import pytest

MOVED = [
    ("nopelens.analyses.streamed", "plan", "nopelens.analyses.plan"),
    ("nopelens.analyses.streamed", "Plan", "nopelens.analyses.plan"),
    ("nopelens.analyses.report", "intervention_figure", "nopelens.analyses.figures"),
    ("nopelens.analyses.report", "model_styles", "nopelens.analyses.palette"),
    ("nopelens.analyses.sweep", "summarize_seed", "nopelens.analyses.summary"),
    ("nopelens.analyses.sweep", "first_variance_block", "nopelens.analyses.sites"),
    ("nopelens.analyses.dynamics", "dynamics_figure", "nopelens.analyses.figures"),
    ("nopelens.analyses.extreme_tokens", "format_report", "nopelens.analyses.cli.extreme_tokens"),
    ("nopelens.probes.fitting", "GATHER_ELEMENTS", "nopelens.probes.moments"),
]
GONE = [
    ("nopelens.models.hf", "MLA_FAMILIES", "family_of"),
    ("nopelens.models.hf", "LEARNED_FAMILIES", "family_of"),
    ("nopelens.probes.sinks", "learned_sink_mass", "sink_table"),
    ("nopelens.probes.targets", "score_differences", "score_read"),
]


@pytest.mark.parametrize("old, name, new", MOVED, ids=[f"{old}.{name}" for old, name, _ in MOVED])
def test_a_moved_name_still_imports_and_says_where_it_lives(old, name, new):
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} moved to {new}\.{name}; import it from there$"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("old, name, instead", GONE, ids=[f"{old}.{name}" for old, name, _ in GONE])
def test_a_gone_name_says_what_to_use_instead(old, name, instead):
    with pytest.raises(AttributeError, match=rf"^{old}\.{name} is gone: .*{instead}"):
        getattr(importlib.import_module(old), name)


def test_an_unknown_name_is_still_an_ordinary_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        importlib.import_module("nopelens.analyses.streamed").no_such_name


def test_sweep_figures_and_svg_are_deprecated_in_one_line():
    from nopelens.analyses.sweep import SweepSettings, sweep

    too_few = dataclasses.replace(SweepSettings.quick(), n_sequences=1)  # refused before any work
    with pytest.warns(DeprecationWarning, match="write_run"), pytest.raises(ValueError, match="fewer"):
        sweep(too_few, figures=True)
