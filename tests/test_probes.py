"""Position targets, grouped probes, controls and metrics: known values and leakage checks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.metrics import accuracy_score, balanced_accuracy_score, r2_score
from sklearn.neighbors import KNeighborsClassifier
from sklearn.preprocessing import StandardScaler

from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import (
    bilinear_features,
    bootstrap_scores,
    collect,
    control_labels,
    extrapolation_splits,
    first_recoverable_layer,
    mad_chance,
    make_probe,
    out_of_fold_predictions,
    pair_features,
    probe_absolute_index,
    probe_features,
    probe_relative_distance,
    resid_sites,
    sample_distance_pairs,
    score,
    sequence_splits,
    token_identity_predictions,
)
from nopelens.probes.metrics import _metric_values, _replicate_chunk, _spearman

LATIN = np.array([[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]])
TEMPLATE = np.tile(np.arange(4), (4, 1))


class Recorder(BaseEstimator, RegressorMixin):
    """Records the (scaled) features it is asked to predict."""

    def fit(self, X, y):
        self.fitted_ = X.copy()
        return self

    def predict(self, X):
        self.__class__.seen = X.copy()
        return np.zeros(len(X))


def test_scaler_is_fit_on_the_fitting_side_only():
    X = np.array([0.0, 1, 2, 3, 10, 11])[:, None]
    groups = np.array([0, 0, 0, 0, 1, 1])
    probe = make_probe("regression").set_params(linear=Recorder())
    out_of_fold_predictions(probe, X, np.zeros(6), [(np.arange(4), np.array([4, 5]))])
    np.testing.assert_allclose(Recorder.seen.ravel(), [7.602631, 8.497058], atol=1e-6)
    leaky = StandardScaler().fit(X).transform(X[4:]).ravel()
    np.testing.assert_allclose(leaky, [1.264563, 1.494483], atol=1e-6)
    # and through the grouped splitter: every fold refits the scaler on its own fitting side
    splits = sequence_splits(groups, n_splits=2)
    for fit, test in splits:
        out_of_fold_predictions(probe, X, np.zeros(6), [(fit, test)])
        expected = StandardScaler().fit(X[fit]).transform(X[test]).ravel()
        np.testing.assert_allclose(Recorder.seen.ravel(), expected)


def test_leakage_layout_one_nearest_neighbour():
    centres = np.array([[0, 0], [10, 0], [0, 10], [10, 10]], dtype=float)
    X = np.array([c + 0.01 * t * np.ones(2) for c in centres for t in range(3)])
    groups = np.repeat(np.arange(4), 3)
    token = np.tile(np.arange(3), 4)
    y = np.repeat([0, 1, 1, 0], 3)
    knn = KNeighborsClassifier(n_neighbors=1)
    token_split = [(np.flatnonzero(token != 1), np.flatnonzero(token == 1))]
    index, pred = out_of_fold_predictions(knn, X, y, token_split)
    assert accuracy_score(y[index], pred) == 1.0
    index, pred = out_of_fold_predictions(knn, X, y, sequence_splits(groups, n_splits=4))
    assert accuracy_score(y[index], pred) == 0.0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=6, max_size=60), st.integers(2, 5))
def test_no_sequence_on_both_sides(group_list, n_splits):
    groups = np.array(group_list)
    if len(np.unique(groups)) < n_splits:
        with pytest.raises(ValueError):
            sequence_splits(groups, n_splits)
        return
    splits = sequence_splits(groups, n_splits)
    scored = np.concatenate([test for _, test in splits])
    assert sorted(scored.tolist()) == list(range(len(groups)))  # each sample scored exactly once
    for fit, test in splits:
        assert not set(groups[fit]) & set(groups[test])


def test_one_sequence_or_too_few_sequences_raise():
    with pytest.raises(ValueError, match="at least 2 sequences"):
        sequence_splits(np.zeros(10, dtype=int))
    with pytest.raises(ValueError, match="5 folds need at least 5 sequences"):
        sequence_splits(np.repeat(np.arange(3), 4), n_splits=5)
    with pytest.raises(ValueError, match="at least 2 sequences"):
        probe_features(np.ones((8, 2)), np.arange(8), np.zeros(8, dtype=int), "regression", controls=False)


def test_latin_square_token_identity_is_chance_and_template_has_zero_selectivity():
    position = np.tile(np.arange(4), 4)
    pred = token_identity_predictions(LATIN.ravel(), position)
    assert accuracy_score(position, pred) == 0.25
    pred = token_identity_predictions(TEMPLATE.ravel(), position)
    control = control_labels(TEMPLATE.ravel(), position, seed=3)
    control_pred = token_identity_predictions(TEMPLATE.ravel(), control)
    assert accuracy_score(position, pred) == 1.0
    assert accuracy_score(position, pred) - accuracy_score(control, control_pred) == 0.0
    # the same through the probe table: a one-hot token-identity probe under grouped CV
    groups = np.repeat(np.arange(4), 4)
    one_hot = np.eye(4)[TEMPLATE.ravel()]
    table = probe_features(one_hot, position, groups, "classification", TEMPLATE.ravel(), n_splits=4, n_boot=50)
    acc = table[table.metric == "accuracy"].set_index("probe")
    assert acc.loc["linear", "value"] == 1.0 and acc.loc["control", "value"] == 1.0
    assert acc.loc["linear", "selectivity"] == 0.0
    assert acc.loc["token_identity", "value"] == 1.0
    latin = probe_features(
        np.eye(4)[LATIN.ravel()], position, groups, "classification", LATIN.ravel(), n_splits=4, n_boot=50
    )
    assert latin.set_index(["probe", "metric"]).loc[("token_identity", "accuracy"), "value"] == 0.25


def test_pooled_lda_matches_sklearn_lda_and_survives_zero_spread():
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    from nopelens.probes.linear import PooledLDA

    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, 400)
    X = rng.normal(size=(400, 6)) + y[:, None] * rng.normal(size=6)
    ours = PooledLDA(shrinkage=0.0).fit(X, y)
    theirs = LinearDiscriminantAnalysis(solver="lsqr").fit(X, y)
    assert (ours.predict(X) == theirs.predict(X)).all()
    np.testing.assert_allclose(ours.coef_, theirs.coef_, rtol=1e-6, atol=1e-8)
    binary = PooledLDA(0.0).fit(X, y > 2)
    assert (binary.predict(X) == LinearDiscriminantAnalysis(solver="lsqr").fit(X, y > 2).predict(X)).all()
    template = np.eye(4)[np.tile(np.arange(4), 3)]
    assert (PooledLDA().fit(template, np.tile(np.arange(4), 3)).predict(np.eye(4)) == np.arange(4)).all()


def test_control_task_keeps_one_label_per_type_and_the_label_distribution():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, 5000)
    labels = rng.integers(0, 4, 5000)
    control = control_labels(tokens, labels, seed=1)
    for t in np.unique(tokens)[:20]:
        assert len(np.unique(control[tokens == t])) == 1
    per_type = pd.Series(control).groupby(tokens).first()
    assert set(per_type) <= set(labels)
    assert abs(per_type.value_counts(normalize=True).sort_index().values - 0.25).max() < 0.08


def test_mad_chance_matches_exhaustive_uniform_pairs():
    for L in (1, 2, 5, 64):
        y, pred = np.meshgrid(np.arange(L), np.arange(L))
        assert score(y.ravel(), pred.ravel(), "mad") == pytest.approx(mad_chance(L))
    assert mad_chance(64) == pytest.approx(21.328125)
    with pytest.raises(ValueError):
        mad_chance(0)


def test_weighted_metrics_equal_library_metrics_on_repeated_samples():
    rng = np.random.default_rng(0)
    n, n_groups = 300, 30
    groups = rng.integers(0, n_groups, n)
    y = rng.integers(0, 6, n)
    pred = np.where(rng.random(n) < 0.6, y, rng.integers(0, 6, n))
    y_real = y + rng.normal(size=n)
    pred_real = y_real + rng.normal(size=n)
    weights = rng.integers(0, 4, (1, n_groups)).astype(float)
    repeat = weights[0, groups].astype(int)
    ey, ep, eyr, epr = (np.repeat(a, repeat) for a in (y, pred, y_real, pred_real))
    got = {
        m: _metric_values(m, y, pred, groups, weights)[0]
        for m in ("accuracy", "balanced_accuracy", "within_one", "mad")
    }
    assert got["accuracy"] == pytest.approx(accuracy_score(ey, ep))
    assert got["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(ey, ep))
    assert got["within_one"] == pytest.approx(np.mean(np.abs(ey - ep) <= 1))
    assert got["mad"] == pytest.approx(np.mean(np.abs(ey - ep)))
    assert _metric_values("r2", y_real, pred_real, groups, weights)[0] == pytest.approx(r2_score(eyr, epr))
    rho = _metric_values("spearman", y, pred_real, groups, weights)[0]  # ties in y
    assert rho == pytest.approx(stats.spearmanr(ey, np.repeat(pred_real, repeat)).statistic)


@pytest.mark.parametrize(
    "kind", ["ties_in_y", "ties_in_both", "real_y_tied_pred", "no_ties", "constant_pred", "few_tied_pred"]
)
def test_weighted_spearman_equals_scipy_on_repeated_samples_for_every_weight_row(kind):
    rng = np.random.default_rng(3)
    n, n_groups = 400, 25
    groups = rng.integers(0, n_groups, n)
    position = rng.integers(0, 12, n)
    noisy = position + rng.normal(size=n)
    few_tied = noisy.copy()
    few_tied[:12], few_tied[200:204] = few_tied[0], few_tied[200]  # 16 of 400 tied: ranked one by one, then fixed
    y, pred = {
        "ties_in_y": (position, noisy),
        "ties_in_both": (position, rng.integers(0, 12, n)),
        "few_tied_pred": (rng.normal(size=n), few_tied),
        "real_y_tied_pred": (noisy, position.astype(float)),
        "no_ties": (rng.normal(size=n), noisy),
        "constant_pred": (position, np.zeros(n)),
    }[kind]
    weights = rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups), size=6).astype(float)
    got = _metric_values("spearman", y, pred, groups, weights)
    for row, value in zip(weights, got):
        repeat = row[groups].astype(int)
        if kind == "constant_pred":
            assert np.isnan(value)
            continue
        assert value == pytest.approx(
            stats.spearmanr(np.repeat(y, repeat), np.repeat(pred, repeat)).statistic, abs=1e-12
        )


def test_spearman_replicates_are_the_same_numbers_whatever_the_chunk():
    rng = np.random.default_rng(4)
    n_groups = 30
    groups = np.repeat(np.arange(n_groups), 50)
    y = np.tile(np.arange(50), n_groups)
    pred = y + rng.normal(0, 5, len(y))
    pred[::9] = np.round(pred[::9])  # tied predictions take the other rank path
    weights = rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups), size=70).astype(float)
    default = _spearman(y, pred, groups, weights)
    for chunk in (1, 3, 64, 100):
        np.testing.assert_array_equal(_spearman(y, pred, groups, weights, chunk=chunk), default)
    assert _replicate_chunk(2048) == 64 and _replicate_chunk(16384) == 16 and _replicate_chunk(10**6) == 8


def test_bootstrap_ci_brackets_the_estimate_and_narrows_with_more_sequences():
    rng = np.random.default_rng(1)

    def width(n_groups):
        groups = np.repeat(np.arange(n_groups), 10)
        y = rng.integers(0, 10, len(groups))
        pred = np.where(rng.random(len(groups)) < 0.7, y, 0)
        value, low, high = bootstrap_scores(y, pred, groups, ["accuracy"], n_boot=300)["accuracy"]
        assert low <= value <= high
        return high - low

    assert width(400) < width(20)
    with pytest.raises(ValueError, match="undefined"):
        bootstrap_scores(np.ones(6), np.arange(6.0), np.arange(6), ["r2"])


def test_distance_pairs_are_balanced_and_within_sequences():
    sequence_id = np.repeat(np.arange(6), [5, 8, 8, 3, 8, 6])
    position = np.concatenate([np.arange(n) for n in [5, 8, 8, 3, 8, 6]])
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(position))  # sample order must not matter
    pairs = sample_distance_pairs(sequence_id[perm], position[perm], seed=2)
    counts = np.bincount(pairs.distance)
    assert len(counts) == 8 and (counts == counts[0]).all() and counts[0] == 3  # distance 7: 3 candidates
    assert (sequence_id[perm][pairs.query] == sequence_id[perm][pairs.key]).all()
    assert (position[perm][pairs.query] - position[perm][pairs.key] == pairs.distance).all()
    assert len(set(zip(pairs.query.tolist(), pairs.key.tolist()))) == len(pairs)
    with pytest.raises(ValueError, match="pairs_per_distance"):
        sample_distance_pairs(sequence_id, position, pairs_per_distance=4)
    with pytest.raises(ValueError, match="0..n_s - 1"):
        sample_distance_pairs(np.zeros(3, int), np.array([0, 2, 3]))


def test_pair_and_bilinear_features():
    h = np.arange(12.0).reshape(6, 2)
    pairs = sample_distance_pairs(np.zeros(6, int), np.arange(6), max_distance=2, pairs_per_distance=2)
    diff = pair_features(h, pairs, "difference")
    assert np.allclose(diff[:, 0], 2.0 * pairs.distance)
    q = np.random.default_rng(0).normal(size=(6, 4, 3))
    k = np.random.default_rng(1).normal(size=(6, 2, 3))  # grouped-query attention: 2 key heads
    outer = bilinear_features(q, k, pairs).reshape(len(pairs), 4, 3, 3)
    # head 3 reads key head 1; the trace of each per-head block is q . k
    np.testing.assert_allclose(np.trace(outer[:, 3], axis1=1, axis2=2), (q[pairs.query, 3] * k[pairs.key, 1]).sum(-1))


def test_pair_and_bilinear_features_of_tensors_are_the_numpy_numbers_on_the_tensors_device():
    """The streamed probes build them from float32 tensors on the model's device; the in-memory path
    from float32 numpy: the same definition gives bit-equal features."""
    rng = np.random.default_rng(2)
    h, q, k = (rng.normal(size=shape).astype(np.float32) for shape in ((9, 5), (9, 4, 3), (9, 2, 3)))
    pairs = sample_distance_pairs(np.zeros(9, int), np.arange(9), max_distance=4, pairs_per_distance=2)
    for kind in ("concat", "difference"):
        out = pair_features(torch.from_numpy(h), pairs, kind)
        assert isinstance(out, torch.Tensor) and np.array_equal(out.numpy(), pair_features(h, pairs, kind))
    for mode in ("outer", "elementwise"):
        out = bilinear_features(torch.from_numpy(q), torch.from_numpy(k), pairs, mode)
        assert isinstance(out, torch.Tensor) and np.array_equal(out.numpy(), bilinear_features(q, k, pairs, mode))
    outer = bilinear_features(q, k, pairs).reshape(len(pairs), 4, 3, 3)
    np.testing.assert_array_equal(outer[:, 1], np.einsum("pe,pf->pef", q[pairs.query, 1], k[pairs.key, 0]))


def test_extrapolation_split_fits_early_positions_and_scores_late_ones():
    groups = np.repeat(np.arange(10), 20)
    position = np.tile(np.arange(20), 10)
    splits = extrapolation_splits(groups, position, boundary=12, n_splits=5)
    for fit, test in splits:
        assert position[fit].max() < 12 <= position[test].min()
        assert not set(groups[fit]) & set(groups[test])
    counting = np.stack([position, np.random.default_rng(0).normal(size=200)], 1)
    saturating = np.stack([np.minimum(position, 11), np.random.default_rng(0).normal(size=200)], 1)
    index, pred = out_of_fold_predictions(make_probe("regression"), counting, position.astype(float), splits)
    assert r2_score(position[index], pred) > 0.99
    index, pred = out_of_fold_predictions(make_probe("regression"), saturating, position.astype(float), splits)
    assert r2_score(position[index], pred) < 0


def test_first_recoverable_layer_uses_the_ci_lower_bound():
    table = pd.DataFrame(
        dict(
            site=[f"s{k}" for k in range(4)],
            layer=pd.array([0, 1, 2, 3], dtype="Int64"),
            target="absolute_index",
            task="regression",
            features="token",
            probe="linear",
            split="grouped",
            metric="r2",
            value=[0.5, 0.93, 0.97, 0.99],
            ci_low=[0.2, 0.85, 0.95, 0.99],
            ci_high=1.0,
        )
    )
    assert first_recoverable_layer(table) == 2
    assert first_recoverable_layer(table, threshold=0.99) == 3
    assert first_recoverable_layer(table, threshold=0.995) is None  # never -1, which would index the last layer
    with pytest.raises(ValueError):
        first_recoverable_layer(table, metric="accuracy")
    both = pd.concat(
        [
            table.assign(metric="mad", ci_high=[3.0, 2.0, 0.5, 0.1]),
            table.assign(metric="mad", task="classification", ci_high=0.0),
        ]
    )
    with pytest.raises(ValueError, match="several task"):
        first_recoverable_layer(both, metric="mad", threshold=1.0)
    assert first_recoverable_layer(both, metric="mad", threshold=1.0, task="regression") == 2


def random_tokens(n_seq, n_ctx, d_vocab, seed=0):
    return torch.randint(0, d_vocab, (n_seq, n_ctx), generator=torch.Generator().manual_seed(seed))


def test_end_to_end_sinusoidal_is_recoverable_at_layer_zero_nope_is_not():
    tokens = random_tokens(40, 16, 100)
    results = {}
    for position in ("sinusoidal", "nope"):
        cfg = DecoderConfig(d_vocab=100, n_ctx=16, n_layers=1, d_model=32, n_heads=4, position=position)
        acts = collect(Decoder(cfg, seed=0), tokens, resid_sites(1))
        results[position] = probe_absolute_index(acts, n_splits=4, n_boot=100)
    sin, nope = results["sinusoidal"], results["nope"]
    assert first_recoverable_layer(sin) == 0
    assert first_recoverable_layer(sin, task="classification") == 0
    nope_layer0 = nope[(nope.layer == 0) & (nope.probe == "linear") & (nope.metric == "r2")]
    assert nope_layer0["ci_high"].iloc[0] < 0.5  # layer 0 of NoPE is token embeddings only
    assert set(sin.probe) == {"linear", "control", "shuffled", "majority", "token_identity"}
    shuffled = sin[(sin.probe == "shuffled") & (sin.metric == "accuracy")]["value"]
    assert (shuffled < 0.2).all()
    acc0 = sin[(sin.metric == "accuracy") & (sin.layer == 0)].set_index("probe")
    assert acc0.loc["linear", "selectivity"] == acc0.loc["linear", "value"] - acc0.loc["control", "value"] > 0
    assert np.isnan(acc0.loc["control", "selectivity"])


def test_relative_distance_probe_runs_on_residual_and_bilinear_sites():
    cfg = DecoderConfig(d_vocab=100, n_ctx=8, n_layers=1, d_model=16, n_heads=2, position="rope")
    sites = resid_sites(1) + ["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k"]
    acts = collect(Decoder(cfg, seed=0), random_tokens(12, 8, 100), sites)
    table = probe_relative_distance(
        acts,
        sites=resid_sites(1),
        attention=[tuple(sites[2:])],
        tasks=("regression",),
        n_splits=3,
        n_boot=50,
        controls=False,
    )
    assert set(table.features) == {"concat", "difference", "bilinear_outer"}
    assert table["value"].notna().all() and (table.target == "relative_distance").all()
    assert table.n_samples.nunique() == 1


def test_extrapolation_rows_score_only_late_positions_of_held_out_sequences():
    cfg = DecoderConfig(d_vocab=100, n_ctx=16, n_layers=1, d_model=16, n_heads=2, position="sinusoidal")
    acts = collect(Decoder(cfg, seed=0), random_tokens(10, 16, 100), [0])
    table = probe_absolute_index(
        acts, tasks=("regression",), controls=False, extrapolate_from=12, n_splits=5, n_boot=50
    )
    late = table[table.split == "extrapolation"]
    assert set(late.metric) == {"r2", "spearman", "mad"} and (late.probe == "linear").all()
    assert (late.n_samples == 10 * 4).all()  # positions 12..15 of every sequence, each scored once
    assert (table[table.split == "grouped"].n_samples == 160).all()


def test_the_pipeline_classifiers_run_through_the_one_engine_streamed_and_in_memory(one_thread):
    """Issue 38 §2: ``logistic`` and ``ridge`` give the same table streamed (features kept) and in
    memory, that of scikit-learn's own pipeline on the same grouped folds; a streamed run whose
    features do not fit the keep budget is refused, not fitted by another model."""
    from sklearn.linear_model import LogisticRegression, RidgeClassifier
    from sklearn.model_selection import GroupKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline

    from nopelens.probes.stream import Sequences, run
    from nopelens.probes.stream_probes import absolute_index_probes

    model = Decoder(
        DecoderConfig(d_vocab=50, n_ctx=32, n_layers=1, d_model=16, n_heads=2, position="rope"), seed=2
    ).eval()
    tokens = torch.randint(0, 50, (9, 8), generator=torch.Generator().manual_seed(3))
    site = "blocks.0.hook_resid_post"
    acts = collect(model, tokens, [site])
    oracles = {"logistic": LogisticRegression(max_iter=1000, random_state=0), "ridge": RidgeClassifier(alpha=1.0)}
    for classifier, oracle in oracles.items():
        common = dict(tasks=("classification",), n_splits=3, n_boot=20, classifier=classifier)
        memory = probe_absolute_index(acts, sites=[site], **common)
        probes = absolute_index_probes(Sequences.of(tokens), [site], keep=None, max_classes=None, **common)
        streamed = run(model, Sequences.of(tokens), [probes], batch_size=4)[0]
        pd.testing.assert_frame_equal(memory, streamed)
        predicted = cross_val_predict(
            make_pipeline(StandardScaler(), oracle),
            acts.features(site).astype(np.float64),
            acts.position,
            groups=acts.sequence_id,
            cv=GroupKFold(3),
        )
        row = memory[(memory.probe == "linear") & (memory.metric == "accuracy")].iloc[0]
        assert row.value == pytest.approx(accuracy_score(acts.position, predicted), abs=1e-6), classifier
    refused = absolute_index_probes(
        Sequences.of(tokens), [site], keep=0, tasks=("classification",), n_splits=3, n_boot=20, classifier="logistic"
    )
    with pytest.raises(ValueError, match="classifier 'logistic' is fitted on the features themselves"):
        run(model, Sequences.of(tokens), [refused], batch_size=4)
    with pytest.raises(ValueError, match="classifier must be"):
        absolute_index_probes(Sequences.of(tokens), [site], classifier="svm")
