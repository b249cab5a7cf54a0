"""Sweep reads: each is one definition that the summary, the figure and the seed tables take their
columns and panels from, and adding one is a definition plus its target function."""

import pandas as pd
import pytest

from nopelens.analyses import reads, report, seeds
from nopelens.analyses.reads import NO_LAYER_CLEARS, SweepRead
from nopelens.analyses.sweep import SweepSettings, sweep
from nopelens.probes import probe_features, site_block, site_layer

SETTINGS = SweepSettings(models=("circuit",), n_sequences=12, seq_len=16, n_boot=20, n_splits=3)


def second_half(inp: reads.ProbeInput) -> pd.DataFrame:
    """A target function: is the token in the second half of its sequence (position >= L/2)?"""
    label = (inp.acts.position >= inp.seq_len // 2).astype(int)
    frames = [probe_features(inp.acts.features(site), label, inp.acts.sequence_id, "classification",
                             inp.acts.token, controls=False, **inp.common)
              .assign(site=site, layer=site_layer(site), block=site_block(site), target="second_half",
                      task="classification", features="token", split="grouped")
              for site in inp.sites.residual]
    return pd.concat(frames, ignore_index=True)


SECOND_HALF = SweepRead("second_half_acc", "second half", "position ≥ L/2",
                        "second_half", "classification", "accuracy", "token", threshold=0.95)


def test_adding_a_read_is_one_definition_plus_its_target_function(monkeypatch, one_thread):
    monkeypatch.setattr(reads, "SWEEP_READS", reads.SWEEP_READS + (SECOND_HALF,))
    monkeypatch.setattr(reads, "TARGETS", {**reads.TARGETS, "second_half": second_half})
    result = sweep(SETTINGS, progress=False)

    measured = result.probes[result.probes["target"] == "second_half"]
    assert set(measured["layer"]) == {0, 1, 2}, "the sweep ran the new target function at every layer"
    # the circuit writes the exact index i into layer 1; layer 0 holds only the BOS flag
    assert list(result.summary.columns[:7]) == ["model", *reads.read_columns()]
    assert result.summary.loc[0, "second_half_acc"] == 1
    assert result.summary.loc[0, "absolute_r2"] == 1, "the existing reads are unchanged"

    table = report.summary_table(result.summary)
    assert "second half acc ≥ 0.95" in table.columns and table.loc[0, "second half acc ≥ 0.95"] == "1"

    curves = result.curves[result.curves["curve"] == "second_half_acc"]
    assert curves["clears"].tolist() == [False, True, True], "the curve says which layers clear the bar"
    assert "second half acc" in report.layer_table(result.curves, "circuit").columns, "the per-layer table gains it"

    figure = report.probe_figure(result.curves)
    titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert titles == [read.title for read in reads.SWEEP_READS[:2]] + ["absolute index: MAD / chance"] + [
        read.title for read in reads.SWEEP_READS[2:]]
    panel = next(ax for ax in figure.axes if ax.get_title() == "position ≥ L/2: accuracy")
    assert panel.lines[-1].get_ydata()[0] == 0.95, "the panel's dashed line is the read's threshold"

    two_seeds = pd.concat([result.summary_per_seed, result.summary_per_seed.assign(train_seed=1)])
    over = seeds.over_seeds(two_seeds)
    assert over.loc[0, "second_half_acc"] == 1 and over.loc[0, "second_half_acc_per_seed"] == "1/1"
    assert "second_half_acc_seed_sd" not in over, "a first layer is agreed over seeds, not averaged"


def test_a_read_names_its_rows_and_its_first_layer():
    probes = pd.DataFrame({
        "probe": "linear", "split": "grouped", "target": "relative_distance", "task": "regression",
        "metric": "r2", "features": ["bilinear_outer"] * 3 + ["score"] * 3, "layer": [1, 2, 3] * 2,
        "ci_low": [0.1, 0.95, 0.99, 0.1, 0.2, 0.3],
    })
    qk, score = (next(r for r in reads.SWEEP_READS if r.column == c)
                 for c in ("relative_content_qk_r2", "relative_score_r2"))
    assert qk.first_layer(probes) == 2, "bilinear_* matches bilinear_outer"
    assert score.first_layer(probes) == NO_LAYER_CLEARS == -1  # the summary table's form
    assert reads.SWEEP_READS[0].first_layer(probes) is None, "no rows: the model has no site for the read"
    assert SweepRead("x", "x", "x", "relative_distance", "regression", "r2", "score", threshold=0.25
                     ).first_layer(probes) == 3


def test_a_read_of_an_unmeasured_target_is_refused(monkeypatch):
    monkeypatch.setattr(reads, "SWEEP_READS", reads.SWEEP_READS + (SECOND_HALF,))
    with pytest.raises(KeyError, match="second_half.*TARGETS"):
        reads.measure_targets(None)
