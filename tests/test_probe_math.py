"""Probe math of issue 10 §1, §3, §4 and issue 13 §1: round-off is not signal, the ridge penalty is
chosen by grouped inner CV, MAD chance comes from the scored positions, and the shared-factorization
fits equal scikit-learn's on the same folds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from nopelens.analyses.sweep import _mad_chance
from nopelens.probes import mad_chance, mad_chance_of, probe_features, score


def _two_lengths():
    """Half the sequences of length 10, half of length 20 (issue 10 §4)."""
    position = np.concatenate([np.arange(length) for length in [10, 20] * 6])
    sequence = np.concatenate([np.full(length, i) for i, length in enumerate([10, 20] * 6)])
    return position, sequence


def test_mad_chance_of_scored_positions_issue_example():
    position, _ = _two_lengths()
    assert mad_chance_of(position) == pytest.approx(6.277778, abs=1e-6)
    assert mad_chance(15) == pytest.approx(4.977778, abs=1e-6)  # the uniform formula at the mean length
    mean_predictor = score(position, np.full(len(position), position.mean()), "mad")
    assert mean_predictor == pytest.approx(4.622222, abs=1e-6)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 30, 200)
    assert mad_chance_of(x) == pytest.approx(np.abs(x[:, None] - x[None, :]).mean())


@pytest.mark.parametrize("length", [1, 2, 7, 64])
def test_mad_chance_of_fixed_length_is_the_uniform_formula(length):
    assert mad_chance_of(np.tile(np.arange(length), 5)) == pytest.approx(mad_chance(length))


def test_mad_chance_of_rejects_bad_input():
    for bad in (np.array([]), np.array([1.0, np.nan]), np.zeros((2, 2))):
        with pytest.raises(ValueError):
            mad_chance_of(bad)


def test_probe_mad_rows_carry_the_chance_of_their_scored_positions():
    position, sequence = _two_lengths()
    X = np.random.default_rng(0).normal(size=(len(position), 3))
    table = probe_features(X, position, sequence, "regression", n_splits=3, n_boot=20, controls=False)
    mad = table[table.metric == "mad"]
    assert mad["chance"].iloc[0] == pytest.approx(6.277778, abs=1e-6)
    assert table[table.metric != "mad"]["chance"].isna().all()
    # the sweep's summary divides by this value, not by the uniform formula at the mean length
    frame = pd.DataFrame(dict(value=[5.0], n_samples=[len(position)], n_sequences=[12], chance=mad["chance"].iloc[:1].values))
    assert _mad_chance(frame).iloc[0] == pytest.approx(6.277778, abs=1e-6)
    assert _mad_chance(frame.drop(columns="chance")).iloc[0] == pytest.approx(mad_chance(15))
