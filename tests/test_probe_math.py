"""Probe math of issue 10 §1, §3, §4 and issue 13 §1: round-off is not signal, the ridge penalty is
chosen by grouped inner CV, MAD chance comes from the scored positions, and the shared-factorization
fits equal scikit-learn's on the same folds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from nopelens.analyses.sweep.layers import chance_of_mad
from nopelens.probes import bootstrap_scores, mad_chance, mad_chance_of, probe_features, score


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
    frame = pd.DataFrame(
        dict(value=[5.0], n_samples=[len(position)], n_sequences=[12], chance=mad["chance"].iloc[:1].values)
    )
    assert chance_of_mad(frame).iloc[0] == pytest.approx(6.277778, abs=1e-6)
    assert chance_of_mad(frame.drop(columns="chance")).iloc[0] == pytest.approx(mad_chance(15))


# ----------------------------------------------------------------------------- §1 round-off

import torch  # noqa: E402

from nopelens.models import Decoder, DecoderConfig  # noqa: E402
from nopelens.probes import collect, first_recoverable_layer, probe_absolute_index, resid_sites  # noqa: E402
from nopelens.probes.roundoff import RoundoffScaler, roundoff_tolerance, signal_mask  # noqa: E402

CONSTANT_CASES = [(p, torch.float32) for p in ("nope", "rope", "alibi", "shaw", ("nope", "rope"))] + [
    ("rope", torch.bfloat16),
    ("rope", torch.float16),
    (("rope", "nope"), torch.bfloat16),
]


@pytest.mark.parametrize("position, dtype", CONSTANT_CASES, ids=lambda v: str(v))
def test_constant_input_without_bos_recovers_nothing(position, dtype):
    """Issue 10 §1: every token id 3, no BOS: exact arithmetic gives every position the same state,
    so no layer may read position from float round-off (today's pipeline read R² ≈ 1 at layer 1)."""
    cfg = DecoderConfig(d_vocab=40, n_ctx=40, n_layers=2, d_model=32, n_heads=4, position=position)
    acts = collect(Decoder(cfg, seed=1).eval().to(dtype), torch.full((50, 30), 3), resid_sites(2))
    assert acts.dtype("blocks.0.hook_resid_post") == str(dtype).removeprefix("torch.")
    table = probe_absolute_index(acts, n_boot=50)  # default controls: one token id, control task undefined
    assert first_recoverable_layer(table, metric="r2") is None
    assert first_recoverable_layer(table, task="classification") is None
    assert "control" not in set(table.probe) and table.selectivity.isna().all()
    assert {"linear", "shuffled", "majority", "token_identity"} <= set(table.probe)
    r2 = table[(table.probe == "linear") & (table.metric == "r2")]
    assert (r2["ci_high"] < 0.05).all()


def test_roundoff_is_judged_by_the_activation_dtype_not_by_noise():
    rng = np.random.default_rng(0)
    base = rng.normal(size=8)
    tiny = base + rng.normal(size=(200, 8)) * 1e-7 * np.abs(base)  # float32-level jitter
    assert not signal_mask(tiny.max(0), tiny.min(0), "float32").any()
    assert signal_mask(tiny.max(0), tiny.min(0), "float64").all()  # far above float64's resolution
    real = base + rng.normal(size=(200, 8)) * 0.2
    assert signal_mask(real.max(0), real.min(0), "bfloat16").all()
    assert roundoff_tolerance("bfloat16") > roundoff_tolerance("float16") > roundoff_tolerance("float32")
    Z = RoundoffScaler("float32").fit(np.c_[tiny[:, :1], real[:, :1]]).transform(np.c_[tiny[:, :1], real[:, :1]])
    assert np.all(Z[:, 0] == 0) and Z[:, 1].std() == pytest.approx(1)
    with pytest.raises(ValueError):
        roundoff_tolerance("int64")


def test_real_position_signal_in_bfloat16_survives():
    cfg = DecoderConfig(d_vocab=40, n_ctx=40, n_layers=1, d_model=32, n_heads=4, position="sinusoidal")
    acts = collect(Decoder(cfg, seed=1).eval().to(torch.bfloat16), torch.full((20, 30), 3), resid_sites(1))
    table = probe_absolute_index(acts, tasks=("regression",), controls=False, n_splits=4, n_boot=50)
    assert first_recoverable_layer(table, metric="r2") == 0


# ----------------------------------------------------------------------------- §3 / 13 §1 shared fits

from sklearn.linear_model import Ridge  # noqa: E402
from sklearn.model_selection import GridSearchCV, GroupKFold, PredefinedSplit  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

from nopelens.probes import PooledLDA, extrapolation_splits, sequence_splits  # noqa: E402
from nopelens.probes.fitting import ALPHAS, GroupedRidgeCV, fit_folds, fold_blocks  # noqa: E402


def _data(n_seq=30, length=12, d=10, seed=0):
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(n_seq), length)
    position = np.tile(np.arange(length), n_seq)
    X = rng.normal(size=(len(groups), d)) * rng.uniform(0.1, 10, d) + rng.normal(size=d) * 5
    X[:, 0] += 0.3 * position
    X[:, 1] += 0.05 * position**1.5
    return X.astype(np.float32), position, groups, rng


def _inner_cv(members, blocks, fit, n):
    test_fold = np.full(n, -1)
    for j in members:
        test_fold[blocks[j]] = j
    return PredefinedSplit(test_fold[fit])


@pytest.mark.parametrize("n_splits, extrapolate", [(5, False), (2, False), (4, True)])
def test_shared_ridge_fits_equal_sklearn_on_the_same_folds(n_splits, extrapolate):
    X, position, groups, rng = _data()
    targets = [position.astype(float), rng.normal(size=len(position))]
    splits = extrapolation_splits(groups, position, 8, n_splits) if extrapolate else sequence_splits(groups, n_splits)
    grid = ALPHAS[::3]  # every third penalty keeps scikit-learn's grid search cheap
    fit = fit_folds(X, targets, groups, splits, "regression", alphas=grid)
    blocks, members = fold_blocks(splits, groups)
    X64 = X.astype(np.float64)
    offset = 0
    for k, (fit_side, score_side) in enumerate(splits):
        for t, y in enumerate(targets):
            search = GridSearchCV(
                make_pipeline(StandardScaler(), Ridge()),
                {"ridge__alpha": list(grid)},
                cv=_inner_cv(members[k], blocks, fit_side, len(X)),
                scoring="neg_mean_squared_error",
            ).fit(X64[fit_side], y[fit_side])
            assert fit.alphas[t][k] == search.best_params_["ridge__alpha"]
            reference = make_pipeline(StandardScaler(), Ridge(alpha=fit.alphas[t][k])).fit(X64[fit_side], y[fit_side])
            np.testing.assert_allclose(
                fit.predictions[t][offset : offset + len(score_side)],
                reference.predict(X64[score_side]),
                rtol=1e-9,
                atol=1e-9,
            )
        offset += len(score_side)
    np.testing.assert_array_equal(fit.index, np.concatenate([s for _, s in splits]))


@pytest.mark.parametrize("d", [1, 2, 3, 64, 300])
def test_penalty_path_equals_one_solve_per_penalty_and_the_eigendecomposition(d):
    """The tridiagonal penalty path (CPU) and the eigendecomposition (accelerators) give the ridge
    weights (C + alpha I)^-1 b of every penalty, also where C is singular (a feature that is the sum
    of two others), so only the penalty makes the system solvable."""
    from nopelens.probes.ridge import _eigen_penalty_path, penalty_path

    rng = np.random.default_rng(d)
    X = rng.normal(size=(2 * d + 5, d)) * rng.uniform(0.1, 10, d)
    if d >= 3:
        X[:, 2] = X[:, 0] + X[:, 1]
    C = torch.from_numpy(np.atleast_2d(np.cov(X.T, bias=True)))
    b = torch.from_numpy(rng.normal(size=(d, 3)))
    alphas = torch.tensor(ALPHAS, dtype=torch.float64)
    W = penalty_path(C, b, alphas)
    eye = torch.eye(d, dtype=torch.float64)
    reference = torch.stack([torch.linalg.solve(C + alpha * eye, b) for alpha in alphas])
    assert W.shape == (len(ALPHAS), d, 3)
    scale = float(reference.abs().max())
    np.testing.assert_allclose(W, reference, rtol=0, atol=1e-10 * scale)
    np.testing.assert_allclose(_eigen_penalty_path(C, b, alphas), W, rtol=0, atol=1e-10 * scale)
    for bad in ([0.0, 1.0], [-1.0], [float("nan")]):
        with pytest.raises(ValueError, match="penalties must be finite numbers > 0"):
            penalty_path(C, b, bad)
    with pytest.raises(ValueError, match="float64 on CPU"):
        penalty_path(C.float(), b.float(), alphas)


def test_spd_solve_equals_lu_and_falls_back_where_cholesky_fails():
    """The final ridge and LDA solves: Cholesky (LAPACK potrf/potrs) equals LU on a positive definite
    system, and a matrix round-off leaves indefinite still gets LU's answer, not an error."""
    from nopelens.probes.ridge import spd_solve

    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 40))
    A = torch.from_numpy(X.T @ X / 80 + 1e-3 * np.eye(40))
    B = torch.from_numpy(rng.normal(size=(40, 3)))
    np.testing.assert_allclose(spd_solve(A, B), torch.linalg.solve(A, B), rtol=1e-10, atol=1e-12)
    indefinite = torch.from_numpy(np.diag(np.r_[np.ones(39), -1.0]))
    np.testing.assert_allclose(spd_solve(indefinite, B), torch.linalg.solve(indefinite, B), rtol=0, atol=1e-15)


def test_a_zero_or_missing_penalty_is_refused_where_the_probes_take_a_grid():
    """A penalty of 0 on collinear features leaves the normal equations singular and makes its own
    validation error round-off: every entry point refuses it in one clear error."""
    X, position, groups, _ = _data()
    splits = sequence_splits(groups, 4)
    for call in (
        lambda a: fit_folds(X, [position.astype(float)], groups, splits, "regression", alphas=a),
        lambda a: GroupedRidgeCV(alphas=a).fit(X, position, groups),
    ):
        for bad in ([0.0, 1e-3, 1.0], [], [1.0, float("inf")]):
            with pytest.raises(ValueError, match="penalties must be finite numbers > 0"):
                call(bad)


def test_shared_lda_fits_equal_pooled_lda_pipeline_on_the_same_folds():
    X, position, groups, rng = _data()
    targets = [position, rng.integers(0, 3, len(position)), rng.permutation(position)]
    splits = sequence_splits(groups, 4)
    fit = fit_folds(X, targets, groups, splits, "classification")
    X64 = X.astype(np.float64)
    offset = 0
    for fit_side, score_side in splits:
        for t, y in enumerate(targets):
            reference = (
                make_pipeline(StandardScaler(), PooledLDA()).fit(X64[fit_side], y[fit_side]).predict(X64[score_side])
            )
            np.testing.assert_array_equal(fit.predictions[t][offset : offset + len(score_side)], reference)
        offset += len(score_side)


def test_grouped_ridge_cv_estimator_equals_grid_search_over_group_kfold():
    X, position, groups, _ = _data()
    Z = StandardScaler().fit_transform(X.astype(np.float64))
    ours = GroupedRidgeCV(n_splits=4).fit(Z, position, groups)
    search = GridSearchCV(
        make_pipeline(StandardScaler(), Ridge()),
        {"ridge__alpha": list(ALPHAS)},
        cv=GroupKFold(4),
        scoring="neg_mean_squared_error",
    )
    search.fit(Z, position, groups=groups)
    assert ours.alpha_ == search.best_params_["ridge__alpha"]
    np.testing.assert_allclose(ours.predict(Z), search.predict(Z), rtol=1e-9, atol=1e-9)
    assert ours.score(Z, position) == pytest.approx(search.best_estimator_.score(Z, position))
    assert GroupedRidgeCV().get_params() == {"alphas": ALPHAS, "n_splits": 4}  # nothing learned in __init__


def test_penalty_at_the_grid_edge_is_flagged():
    X, position, groups, rng = _data()
    exact = X.astype(np.float64) @ rng.normal(size=X.shape[1])  # noiseless: the least penalty wins
    table = probe_features(X, exact, groups, "regression", controls=False, n_splits=4, n_boot=20)
    assert table["alpha_at_edge"].all() and (table["alpha"] == ALPHAS[0]).all()
    table = probe_features(X, position, groups, "regression", controls=False, n_splits=4, n_boot=20)
    assert not table["alpha_at_edge"].any() and ALPHAS[0] < table["alpha"].iloc[0] < ALPHAS[-1]


@pytest.mark.slow
def test_untrained_nope_control_reads_no_negative_r2_at_any_site():
    """Issue 10 §3 known answer: the sweep's untrained-nope control (as the sweep builds and probes it)
    read R² −0.86 at blocks.0.hook_attn_out with leave-one-token-out penalties; with the grouped
    inner CV no site may read below −0.05."""
    from nopelens.analyses.subjects import qk_sites, resolve
    from nopelens.analyses.sweep import SweepSettings
    from nopelens.analyses.sweep.reads import bilinear_mode
    from nopelens.probes import probe_relative_distance

    settings = SweepSettings.default()
    subject = resolve("untrained-nope", settings.n_sequences, settings.seq_len, settings.seed, False)
    layers = subject.n_layers
    sites = resid_sites(layers) + [f"blocks.{l}.hook_{kind}_out" for l in range(layers) for kind in ("attn", "mlp")]
    qk = [qk_sites(subject.model, l) for l in range(layers)]
    acts = collect(
        subject.model, subject.tokens, sites + [s for pair in qk for s in pair], attention_mask=subject.attention_mask
    )
    common = dict(tasks=("regression",), controls=False, n_splits=settings.n_splits, n_boot=10)
    absolute = probe_absolute_index(acts, sites=sites, **common)
    relative = probe_relative_distance(
        acts,
        sites=resid_sites(layers),
        feature_kinds=("concat",),
        attention=qk,
        bilinear=bilinear_mode(acts, qk[0][0]),
        pairs_per_distance=64,
        **common,
    )
    r2 = pd.concat([absolute, relative])
    r2 = r2[r2.metric == "r2"]
    assert len(r2) == len(sites) + 2 * layers + 1
    assert (r2["value"] >= -0.05).all(), r2[["site", "features", "value", "alpha"]]


def test_torch_input_and_device_option_give_the_same_math():
    X, position, groups, _ = _data()
    splits = sequence_splits(groups, 4)
    y = position.astype(float)
    reference = fit_folds(X, [y], groups, splits, "regression")
    from_torch = fit_folds(torch.as_tensor(X), [y], groups, splits, "regression", device="cpu")
    np.testing.assert_allclose(from_torch.predictions[0], reference.predictions[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="float64 on CPU"):
        fit_folds(X, [y], groups, splits, "regression", compute_dtype=torch.float32)
    if torch.cuda.is_available():  # optional: runs where a GPU exists, never needed in CI
        for dtype, tolerance in ((torch.float64, 1e-8), (torch.float32, 1e-2)):
            gpu = fit_folds(X, [y], groups, splits, "regression", device="cuda", compute_dtype=dtype)
            np.testing.assert_allclose(gpu.predictions[0], reference.predictions[0], atol=tolerance * position.max())


def test_make_probe_pipeline_takes_groups_for_its_inner_cv():
    from nopelens.probes import make_probe, out_of_fold_predictions

    X, position, groups, _ = _data()
    splits = sequence_splits(groups, 4)
    index, pred = out_of_fold_predictions(
        make_probe("regression", n_inner=3), X, position.astype(float), splits, groups
    )
    assert len(index) == len(X) and np.isfinite(pred).all()
    probe = make_probe("regression").fit(X, position, linear__groups=groups)
    assert probe.named_steps["linear"].alpha_ in ALPHAS


def test_spearman_ties_predictions_that_differ_only_by_round_off():
    """Identical feature rows get predictions a last bit apart, depending on where each row sits in
    a matrix product; ranked as distinct, that noise moved rho by up to 1e-2 on the circuit."""
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    y = np.tile(np.arange(8), 30)
    exact = np.round(y + rng.normal(0, 2.0, len(y)))  # many exact ties, as rows of repeated tokens give
    noisy = exact * (1 + rng.choice([-1, 0, 1], len(y)) * np.finfo(float).eps)  # the same, an ulp apart
    groups = np.repeat(np.arange(30), 8)
    assert not np.array_equal(np.unique(noisy), np.unique(exact))
    on_exact = bootstrap_scores(y, exact, groups, ["spearman"], n_boot=50)["spearman"]
    on_noisy = bootstrap_scores(y, noisy, groups, ["spearman"], n_boot=50)["spearman"]
    assert on_noisy == on_exact
    assert on_exact[0] == pytest.approx(spearmanr(y, exact).statistic, abs=1e-12)
    assert (
        bootstrap_scores(y, y + 1e-6 * rng.normal(size=len(y)), groups, ["spearman"], n_boot=5)["spearman"][0] < 1.0
    ), "real differences, far above round-off, still rank"


@pytest.mark.parametrize("as_tensor", [False, True])
def test_fold_statistics_judge_float64_features_by_their_raw_extremes(as_tensor):
    """float64 features are already in the compute dtype, so the centred copy must not be the features'
    own memory: the round-off rule reads the raw extremes. A feature of 1000 plus 2e-12 noise is round-off at
    its scale (float64 tolerance x 1000 = 5.9e-11 > its spread); judged from its centred values (magnitude
    ~1e-11, the other feature's ~4) it passed as signal."""
    from nopelens.probes.moments import fold_statistics

    rng = np.random.default_rng(0)
    n = 400
    X = np.stack([1000 + 2e-12 * rng.standard_normal(n), rng.standard_normal(n)], 1)
    groups = np.repeat(np.arange(20), 20)
    stats = fold_statistics(
        torch.from_numpy(X.copy()) if as_tensor else X.copy(),
        groups,
        sequence_splits(groups, 5),
        [rng.standard_normal(n)],
    )
    high, low = stats.moments.high.max(0).values, stats.moments.low.min(0).values
    assert np.array_equal(high.numpy(), X.max(0)) and np.array_equal(low.numpy(), X.min(0))
    assert signal_mask(high, low, "float64").tolist() == [False, True]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_fold_statistics_reorders_features_row_by_row_and_keeps_the_extremes_of_a_narrowing(as_tensor, monkeypatch):
    """The reordered copy is filled a few rows at a time (here 3): every row lands in its place, in the
    compute dtype. The extremes come from that copy; rounding is monotone, so for a narrowing conversion
    (float64 features, float32 algebra on an accelerator) they are the rounded raw extremes."""
    from nopelens.probes import moments

    monkeypatch.setattr(moments, "GATHER_ELEMENTS", 7)  # 3 rows of 2 features at a time
    rng = np.random.default_rng(1)
    X = rng.standard_normal((11, 2)).astype(np.float32)
    order = rng.permutation(11)
    out = moments._gathered(torch.from_numpy(X) if as_tensor else X, order, "cpu", torch.float64)
    assert out.dtype == torch.float64 and np.array_equal(out.numpy(), X[order].astype(np.float64))
    wide = X.astype(np.float64) + 1e-12
    out = moments._gathered(torch.from_numpy(wide) if as_tensor else wide, order, "cpu", torch.float32)
    assert np.array_equal(out.numpy(), wide[order].astype(np.float32))
    assert np.array_equal(out.numpy().max(0), wide.max(0).astype(np.float32))
    assert np.array_equal(out.numpy().min(0), wide.min(0).astype(np.float32))
