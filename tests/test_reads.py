"""Sweep reads: each is one definition that the summary, the figure and the seed tables take their
columns and panels from, and adding one is a definition plus its target function."""

import pandas as pd
import pytest

from nopelens.analyses import report
from nopelens.analyses.sweep import SweepSettings, reads, seeds, sweep
from nopelens.analyses.sweep.reads import NO_LAYER_CLEARS, SweepRead
from nopelens.probes.stream_probes import token_probes

SETTINGS = SweepSettings(models=("circuit",), n_sequences=12, seq_len=16, n_boot=20, n_splits=3)


def second_half(inp: reads.ProbeInput):
    """A new read's one definition: is the token in the second half of its sequence (position >= L/2)?"""
    label = (inp.sequences.position >= inp.seq_len // 2).astype(int)
    return token_probes(
        inp.sequences,
        inp.sites.residual,
        ("second_half", label),
        n_splits=inp.n_splits,
        n_boot=inp.n_boot,
        seed=inp.seed,
        keep=inp.keep,
    )


SECOND_HALF = SweepRead(
    "second_half_acc",
    "second half",
    "position ≥ L/2",
    "second_half",
    "classification",
    "accuracy",
    "token",
    threshold=0.95,
)


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
        read.title for read in reads.SWEEP_READS[2:]
    ]
    panel = next(ax for ax in figure.axes if ax.get_title() == "position ≥ L/2: accuracy")
    assert panel.lines[-1].get_ydata()[0] == 0.95, "the panel's dashed line is the read's threshold"

    two_seeds = pd.concat([result.summary_per_seed, result.summary_per_seed.assign(train_seed=1)])
    over = seeds.over_seeds(two_seeds)
    assert over.loc[0, "second_half_acc"] == 1 and over.loc[0, "second_half_acc_per_seed"] == "1/1"
    assert "second_half_acc_seed_sd" not in over, "a first layer is agreed over seeds, not averaged"


def test_a_read_names_its_rows_and_its_first_layer():
    probes = pd.DataFrame(
        {
            "probe": "linear",
            "split": "grouped",
            "target": "relative_distance",
            "task": "regression",
            "metric": "r2",
            "features": ["bilinear_outer"] * 3 + ["score"] * 3,
            "layer": [1, 2, 3] * 2,
            "ci_low": [0.1, 0.95, 0.99, 0.1, 0.2, 0.3],
        }
    )
    qk, score = (
        next(r for r in reads.SWEEP_READS if r.column == c) for c in ("relative_content_qk_r2", "relative_score_r2")
    )
    assert qk.first_layer(probes) == 2, "bilinear_* matches bilinear_outer"
    assert score.first_layer(probes) == NO_LAYER_CLEARS == -1  # the summary table's form
    assert reads.SWEEP_READS[0].first_layer(probes) is None, "no rows: the model has no site for the read"
    assert (
        SweepRead("x", "x", "x", "relative_distance", "regression", "r2", "score", threshold=0.25).first_layer(probes)
        == 3
    )


def test_a_read_of_an_unmeasured_target_is_refused(monkeypatch):
    monkeypatch.setattr(reads, "SWEEP_READS", reads.SWEEP_READS + (SECOND_HALF,))
    with pytest.raises(KeyError, match="second_half.*TARGETS"):
        reads.measure_targets(None)


def test_a_new_read_is_one_definition_measured_streamed_and_in_memory(one_thread):
    """Issue 38: the toy read's one definition runs streamed (statistics only, nothing kept) and in
    memory (cached activations replayed into the same engine), with the same table."""
    import numpy as np
    import torch

    from nopelens.models import Decoder, DecoderConfig
    from nopelens.probes import collect, resid_sites
    from nopelens.probes.stream import KeepBudget, Sequences, run

    model = Decoder(
        DecoderConfig(d_vocab=50, n_ctx=32, n_layers=2, d_model=16, n_heads=2, position="rope"), seed=1
    ).eval()
    tokens = torch.randint(0, 50, (9, 12), generator=torch.Generator().manual_seed(4))
    sites = reads.SweepSites(resid_sites(2), [], [], [], [])

    def read_input(sequences, keep):
        return reads.ProbeInput(sequences, sites, seq_len=12, n_sequences=9, n_splits=3, n_boot=20, seed=0, keep=keep)

    streamed = run(
        model, Sequences.of(tokens), [second_half(read_input(Sequences.of(tokens), KeepBudget(0)))], batch_size=4
    )[0]
    acts = collect(model, tokens, sites.all())
    memory = reads.measure_in_memory([second_half(read_input(Sequences.of_activations(acts), None))], acts)
    assert set(memory["target"]) == {"second_half"} and set(memory["site"]) == set(sites.residual)
    assert list(memory.columns) == list(streamed.columns) and len(memory) == len(streamed)
    for column in memory.columns:
        if memory[column].dtype.kind == "f":
            np.testing.assert_allclose(streamed[column], memory[column], rtol=1e-8, atol=1e-8, equal_nan=True)
        else:
            assert streamed[column].tolist() == memory[column].tolist(), column
