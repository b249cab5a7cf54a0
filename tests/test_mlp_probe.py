"""Haviv et al.'s MLP position probe (issue 45): known answers, floors, bounded memory, determinism."""

import numpy as np
import pytest
import torch

from nopelens.analyses.subjects import resolve
from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import collect, mad_chance, resid_sites
from nopelens.probes.linear import out_of_fold_predictions, sequence_splits
from nopelens.probes.mlp_probe import (
    MLPPositionProbe,
    constant_prediction_band,
    kept_sequences,
    make_mlp_probe,
    no_information_floor,
    probe_positions_mlp,
)


def _mad_chance(rows, probe="linear"):
    row = rows[(rows["probe"] == probe) & (rows["metric"] == "mad")].iloc[0]
    return row["value"] / row["chance"], row


def test_floors_are_derived_not_assumed():
    for n in (4, 64, 1024):
        positions = np.arange(n)
        # a regression probe that knows nothing predicts the mean: (L / 4) / ((L^2 - 1) / (3L)) for even L
        assert no_information_floor(positions, "mean") == pytest.approx(3 * n**2 / (4 * (n**2 - 1)))
        # an argmax that knows nothing picks one class c; over c drawn like the targets that is chance itself
        by_class = np.mean([np.abs(positions - c).mean() for c in positions]) / mad_chance(n)
        assert no_information_floor(positions, "argmax") == pytest.approx(by_class)
    low, high = constant_prediction_band(np.arange(64))
    assert low == pytest.approx(no_information_floor(np.arange(64), "mean"), abs=0.01) and high > 1.4
    with pytest.raises(ValueError, match="no spread"):
        no_information_floor(np.zeros(5), "mean")
    with pytest.raises(ValueError, match="'mean' or 'argmax'"):
        no_information_floor(np.arange(5), "median")


def test_constant_input_gives_the_no_information_floor_at_every_layer(one_thread):
    subject = resolve("constant-nope", n_sequences=12, seq_len=16)
    sites = resid_sites(subject.n_layers)
    acts = collect(subject.model, subject.tokens, sites)
    splits = sequence_splits(acts.sequence_id, 3)
    low, high = constant_prediction_band(acts.position)
    for site in sites:
        X = acts.features(site)
        probe = make_mlp_probe(dtype=acts.dtype(site), epochs=3, min_steps=50)  # nothing to learn: short fits
        index, pred = out_of_fold_predictions(probe, X, acts.position, splits)
        for _, score in splits:  # the probe read nothing: one class per fold, whatever the token
            assert len(np.unique(pred[np.isin(index, score)])) == 1, site
        rows = probe_positions_mlp(
            X, acts.position, acts.sequence_id, acts.token, 3, n_boot=20, dtype=acts.dtype(site), epochs=3, min_steps=50
        )
        value, row = _mad_chance(rows)
        assert low - 1e-9 <= value <= high + 1e-9 and row["floor"] == 1.0, (site, value)


def test_an_untrained_sinusoidal_model_is_near_exact_at_layer_0(one_thread):
    config = DecoderConfig(d_vocab=20, n_ctx=32, n_layers=1, d_model=32, n_heads=2, position="sinusoidal")
    model = Decoder(config, seed=0).eval()
    tokens = torch.randint(0, 20, (30, 32), generator=torch.Generator().manual_seed(0))
    acts = collect(model, tokens, resid_sites(1)[:1])
    rows = probe_positions_mlp(
        acts.features(resid_sites(1)[0]), acts.position, acts.sequence_id, acts.token, 3, controls=False, n_boot=50
    )  # the default epochs: what the comparison fits
    value, row = _mad_chance(rows)
    assert value <= 0.01 and row["ci_high"] / row["chance"] <= 0.01


def test_the_hand_built_circuit_is_read_exactly_at_layer_1(one_thread):
    """Layer 1 of the circuit holds i and i^2 exactly (ridge reads them with MAD 3e-4), beside the
    token's embedding. With the comparison's fixed training the argmax puts every held-out token on
    its own position once the fitting side has 160 windows (about 10 per feature and class); with 20
    it put 13 % one position off (held-out accuracy 0.87, 0.95, 0.99, 1.0 at 30, 60, 120, 240 windows):
    the extra samples teach it to ignore the token dimensions."""
    subject = resolve("circuit", n_sequences=240, seq_len=16)
    site = resid_sites(subject.n_layers)[1]
    acts = collect(subject.model, subject.tokens, [site], subject.attention_mask)
    rows = probe_positions_mlp(
        acts.features(site), acts.position, acts.sequence_id, acts.token, 3, controls=False, n_boot=20
    )  # the default training, as the comparison fits
    value, row = _mad_chance(rows)
    accuracy = rows[(rows["probe"] == "linear") & (rows["metric"] == "accuracy")]["value"].iloc[0]
    assert accuracy == 1 and value == 0 and row["ci_high"] == 0 and row["n_sequences"] == 240


def test_same_seed_same_numbers_and_bad_input(one_thread):
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(120, 5)).astype(np.float32), np.tile(np.arange(12), 10)
    first = MLPPositionProbe(epochs=3, seed=4, min_steps=0).fit(X, y).decision_function(X)
    assert np.array_equal(first, MLPPositionProbe(epochs=3, seed=4, min_steps=0).fit(X, y).decision_function(X))
    assert not np.array_equal(first, MLPPositionProbe(epochs=3, seed=5, min_steps=0).fit(X, y).decision_function(X))
    with pytest.raises(ValueError, match="at least 2 classes"):
        MLPPositionProbe().fit(X, np.zeros(120, dtype=int))
    with pytest.raises(ValueError, match="epochs"):
        MLPPositionProbe(epochs=0).fit(X, y)
    with pytest.raises(ValueError, match="NaN or Inf"):
        probe_positions_mlp(np.full((120, 5), np.nan), y, np.repeat(np.arange(10), 12), y)


def test_the_memory_budget_sets_the_kept_sequences():
    kept = kept_sequences(500, 257, 4 * 128 * 7, 64 << 20, seed=1)
    assert len(kept) == (64 << 20) // (257 * 4 * 128 * 7) and np.all(np.diff(kept) > 0) and kept.max() < 500
    assert np.array_equal(kept, kept_sequences(500, 257, 4 * 128 * 7, 64 << 20, seed=1))
    with pytest.raises(ValueError, match="keeps 0 sequences.*needs at least 10"):
        kept_sequences(500, 257, 4 * 128 * 7, 1000)
