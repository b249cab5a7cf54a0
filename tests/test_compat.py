"""Names that moved in issue 39's reorganisation still import, with a one-line deprecation naming
their new home; names that went say what to use instead."""

import dataclasses
import importlib
import sys

import pytest

MOVED = [
    ("nopelens.analyses.sweep.streamed", "plan", "nopelens.analyses.sweep.plan"),
    ("nopelens.analyses.sweep.streamed", "Plan", "nopelens.analyses.sweep.plan"),
    ("nopelens.analyses.report", "intervention_figure", "nopelens.analyses.command_figures"),
    ("nopelens.analyses.report", "model_styles", "nopelens.analyses.palette"),
    ("nopelens.analyses.sweep.driver", "summarize_seed", "nopelens.analyses.sweep.summary"),
    ("nopelens.analyses.sweep.driver", "first_variance_block", "nopelens.analyses.sweep.sites"),
    ("nopelens.analyses.dynamics", "dynamics_figure", "nopelens.analyses.command_figures"),
    ("nopelens.analyses.figures", "intervention_figure", "nopelens.analyses.command_figures"),
    ("nopelens.analyses.figures", "dynamics_figure", "nopelens.analyses.command_figures"),
    ("nopelens.analyses.extreme_tokens", "format_report", "nopelens.analyses.cli.extreme_tokens"),
    ("nopelens.probes.fitting", "GATHER_ELEMENTS", "nopelens.probes.moments"),
    ("nopelens.analyses.sweep.driver", "measure_sinks", "nopelens.analyses.sweep.streamed"),
    ("nopelens.probes.stream", "AttentionVariance", "nopelens.probes.variance"),
    ("nopelens.probes.stream", "ROWS_AT_ONCE", "nopelens.probes.variance"),
]
GONE = [
    ("nopelens.models.hf", "MLA_FAMILIES", "family_of"),
    ("nopelens.models.hf", "LEARNED_FAMILIES", "family_of"),
    ("nopelens.probes.sinks", "learned_sink_mass", "sink_table"),
    ("nopelens.probes.targets", "score_differences", "score_read"),
    ("nopelens.analyses.sweep.driver", "analyse_subject_streamed", "analyse_subject"),
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
        _ = importlib.import_module("nopelens.analyses.sweep.streamed").no_such_name


def test_sweep_figures_and_svg_are_deprecated_in_one_line():
    from nopelens.analyses.sweep import SweepSettings, sweep

    too_few = dataclasses.replace(SweepSettings.quick(), n_sequences=1)  # refused before any work
    with pytest.warns(DeprecationWarning, match="write_run"), pytest.raises(ValueError, match="fewer"):
        sweep(too_few, figures=True)


SWEEP_MODULES = ("eta", "layers", "parallel", "plan", "reads", "seeds", "settings", "sites", "streamed", "summary")


@pytest.mark.parametrize("name", SWEEP_MODULES)
def test_a_sweep_module_that_moved_into_the_subpackage_still_imports_and_says_where(name, monkeypatch):
    """Issue 49: ``nopelens.analyses.reads`` and the rest moved into ``nopelens.analyses.sweep``."""
    import nopelens.analyses

    old, new = f"nopelens.analyses.{name}", f"nopelens.analyses.sweep.{name}"
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(nopelens.analyses, name, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}; import it from there$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert nopelens.analyses.SWEEP_MODULES == SWEEP_MODULES


def test_the_sweep_package_gives_the_drivers_names_and_imports_a_module_alone():
    """``from nopelens.analyses.sweep import sweep`` as before the move; importing one of its modules
    (``eta``) in a fresh interpreter does not load the driver."""
    import subprocess

    from nopelens.analyses.sweep import driver, sweep

    assert sweep is driver.sweep
    code = "import sys, nopelens.analyses.sweep.eta; print('nopelens.analyses.sweep.driver' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False"
    ]
