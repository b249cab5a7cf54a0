"""Benchmark: probe fitting against scikit-learn and against the FLOP floor, side by side in one run.

Features: one residual site of an untrained 4-layer, d_model-128 decoder on 20,032 tokens (313
sequences of 64), 5-fold GroupKFold by sequence. For the absolute index as a value it times, in
one run and on the same data:

- **floor**: one Gram product ``X^T X`` of the whole ``[20032, 128]`` feature matrix in float64
  (numpy, BLAS syrk) -- the least linear algebra any least-squares probe of these features needs;
- **ours**: ``probe_features(X, y, groups, "regression", controls=False, n_boot=1)`` -- grouped
  5-fold probe with the ridge penalty chosen by a grouped inner CV over 28 penalties
  (1e-3 .. 1e6), point metrics included; and the same call with the default controls (control
  task, shuffled labels, majority, token identity);
- **scikit-learn** (on the float64 copy of ``X``, as ours computes): the same model fold by fold:
  ``GridSearchCV(Pipeline(StandardScaler, Ridge),
  28 penalties, cv=the same inner folds)`` refit per outer fold; its predictions are compared
  with ours (max abs difference). Also the previous default, ``Pipeline(StandardScaler,
  RidgeCV(alphas=(0.1, 1, 10)))`` (token-level leave-one-out), for reference; and issue 38 §4's
  peer ratio: one layer's absolute-index regression probe through the engine
  (``probe_absolute_index``) against that GridSearchCV and against ``RidgeCV`` (leave-one-out over
  the same 28 penalties) in the same outer GroupKFold, with both speed-ups and whether R^2 agrees
  to 1e-4.
- classification: shared-statistics pooled LDA vs the ``Pipeline(StandardScaler, PooledLDA)``.

The bootstrap CIs (``n_boot`` replicates over sequences) are a separate cost, printed on its own
line: Spearman's rho needs a re-ranking per replicate.

Run single-threaded (``--threads 1``, the default): on a shared machine, BLAS threads on
oversubscribed cores spin-wait. Each timing is the best of ``--repeats`` runs (wall seconds) with
the CPU seconds of that run next to it; the load average is printed before and after, because on
a loaded machine wall time measures the contention as much as the code.

    python benchmarks/bench_probes.py

Not a test: it prints measured numbers and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from sklearn.linear_model import Ridge, RidgeCV
from sklearn.metrics import r2_score
from sklearn.model_selection import GridSearchCV, PredefinedSplit
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import (
    PooledLDA,
    bootstrap_scores,
    collect,
    control_labels,
    out_of_fold_predictions,
    probe_absolute_index,
    probe_features,
    resid_sites,
    sequence_splits,
    shuffled_labels,
)
from nopelens.probes.fitting import ALPHAS, fit_folds, fold_blocks


def build_activations(position: str, n_samples: int, seed: int, init_std: float = 0.02):
    n_ctx = 64
    cfg = DecoderConfig(
        d_vocab=512, n_ctx=n_ctx, n_layers=4, d_model=128, n_heads=4, position=position, init_std=init_std
    )
    model = Decoder(cfg, seed=seed)
    n_seq = -(-n_samples // n_ctx)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.d_vocab, (n_seq, n_ctx), generator=generator)
    mask = torch.ones_like(tokens)
    mask.view(-1)[n_samples:] = 0  # right-pad the last sequence so there are exactly n_samples tokens
    return collect(model, tokens, resid_sites(cfg.n_layers), attention_mask=mask, batch_size=64)


def timed(fn, repeats: int = 1):
    """(result, best wall seconds, CPU seconds of that run)."""
    best = (None, np.inf, np.inf)
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall = time.perf_counter() - start
        if wall < best[1]:
            best = (out, wall, time.process_time() - cpu)
    return best


def sklearn_grouped_ridge(X, y, groups, splits):
    """The model ``fit_folds`` fits, through scikit-learn: per outer fold, GridSearchCV over the
    scaler + ridge pipeline with the same inner folds (the fitting side's blocks)."""
    blocks, members = fold_blocks(splits, groups)
    index, preds = [], []
    for k, (fit, score) in enumerate(splits):
        test_fold = np.full(len(X), -1)
        for j in members[k]:
            test_fold[blocks[j]] = j
        search = GridSearchCV(
            make_pipeline(StandardScaler(), Ridge()),
            {"ridge__alpha": list(ALPHAS)},
            cv=PredefinedSplit(test_fold[fit]),
            scoring="neg_mean_squared_error",
        )
        search.fit(X[fit], y[fit])
        index.append(score)
        preds.append(search.predict(X[score]))
    return np.concatenate(index), np.concatenate(preds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--position", default="sinusoidal", help="position method of the untrained model")
    parser.add_argument("--samples", type=int, default=20_032)
    parser.add_argument("--site", default="blocks.1.hook_resid_post")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs for our timings")
    parser.add_argument("--n-boot", type=int, default=1000, help="replicates for the separate bootstrap line")
    parser.add_argument("--skip-sklearn", action="store_true", help="skip the (slow) scikit-learn grid search")
    parser.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP/torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    acts = build_activations(args.position, args.samples, args.seed)
    X, y, groups, tokens = acts.features(args.site), acts.position, acts.sequence_id, acts.token
    yf = y.astype(np.float64)
    splits = sequence_splits(groups, n_splits=5)
    X64 = X.astype(np.float64)
    print(
        f"{args.position} decoder, {args.site}: X {X.shape} {X.dtype}, {acts.n_sequences} sequences, 5-fold "
        f"GroupKFold, {len(ALPHAS)} penalties; {args.threads} thread(s); load average before {os.getloadavg()}"
    )

    _, floor, floor_cpu = timed(lambda: X64.T @ X64, args.repeats)
    rows = [("floor: X^T X (float64)", floor, floor_cpu)]
    _, wall, cpu = timed(lambda: fit_folds(X, [yf], groups, splits, "regression"), args.repeats)
    rows.append(("ours: fit_folds, 1 target", wall, cpu))
    targets = [yf, control_labels(tokens, yf), shuffled_labels(yf)]
    _, wall, cpu = timed(lambda: fit_folds(X, targets, groups, splits, "regression"), args.repeats)
    rows.append(("ours: fit_folds, 3 targets", wall, cpu))
    _, plain, cpu = timed(lambda: probe_features(X, y, groups, "regression", controls=False, n_boot=1), args.repeats)
    rows.append(("ours: probe_features, no controls", plain, cpu))
    _, controls, cpu = timed(lambda: probe_features(X, y, groups, "regression", tokens, n_boot=1), args.repeats)
    rows.append(("ours: probe_features, controls", controls, cpu))
    ours = fit_folds(X, [yf], groups, splits, "regression")
    if not args.skip_sklearn:
        (index, pred), wall, cpu = timed(lambda: sklearn_grouped_ridge(X64, yf, groups, splits))
        rows.append(("sklearn: GridSearchCV same folds", wall, cpu))
        difference = np.abs(pred - ours.predictions[0]).max() if np.array_equal(index, ours.index) else np.nan
        sklearn_wall = wall
        (loo_index, loo_pred), loo_wall, cpu = timed(
            lambda: out_of_fold_predictions(make_pipeline(StandardScaler(), RidgeCV(alphas=ALPHAS)), X64, yf, splits)
        )
        rows.append(("sklearn: RidgeCV LOO, 28 penalties", loo_wall, cpu))
        _, wall, cpu = timed(
            lambda: out_of_fold_predictions(
                make_pipeline(StandardScaler(), RidgeCV(alphas=(0.1, 1, 10))), X64, yf, splits
            )
        )
        rows.append(("sklearn: previous RidgeCV (LOO)", wall, cpu))
        # issue 38 §4: one layer's absolute-index regression probe through the engine (the in-memory API)
        table, engine_wall, cpu = timed(
            lambda: probe_absolute_index(acts, sites=[args.site], tasks=("regression",), controls=False, n_boot=1),
            args.repeats,
        )
        rows.append(("ours: probe_absolute_index (engine)", engine_wall, cpu))
        engine_r2 = table[(table.probe == "linear") & (table.metric == "r2")]["value"].iloc[0]
        peer_r2 = {"GridSearchCV": r2_score(yf[index], pred), "RidgeCV LOO": r2_score(yf[loo_index], loo_pred)}
    _, wall, cpu = timed(lambda: fit_folds(X, [y], groups, splits, "classification"), args.repeats)
    rows.append(("ours: LDA, 1 target", wall, cpu))
    _, wall, cpu = timed(lambda: out_of_fold_predictions(make_pipeline(StandardScaler(), PooledLDA()), X64, y, splits))
    rows.append(("sklearn pipeline: PooledLDA", wall, cpu))
    pred = ours.predictions[0]
    _, wall, cpu = timed(
        lambda: bootstrap_scores(yf[ours.index], pred, groups[ours.index], ("r2", "spearman", "mad"), args.n_boot)
    )
    rows.append((f"bootstrap CIs, {args.n_boot} replicates", wall, cpu))

    print(f"{'what':38s} {'wall s':>8s} {'cpu s':>8s} {'x floor':>8s}")
    for name, wall, cpu in rows:
        print(f"{name:38s} {wall:8.4f} {cpu:8.4f} {wall / floor:8.1f}")
    print(
        f"controls add {100 * (controls / plain - 1):.0f} % to probe_features (goal <= 50 %); "
        f"probe_features without controls is {plain / floor:.1f}x the floor (goal <= 10x)"
    )
    if not args.skip_sklearn:
        print(
            f"max |ours - scikit-learn| over the out-of-fold predictions: {difference:.2e}; chosen penalties per fold: "
            f"{ours.alphas[0].tolist()}"
        )
        print(
            f"peer ratio (issue 38 §4), one layer's absolute-index regression probe: the engine is "
            f"{sklearn_wall / engine_wall:.1f}x faster than the equal-work GridSearchCV and "
            f"{loo_wall / engine_wall:.1f}x faster than RidgeCV's leave-one-out search in the same outer GroupKFold; "
            f"R^2 {engine_r2:.6f}, "
            + ", ".join(
                f"{name} {r2:.6f} (|diff| {abs(r2 - engine_r2):.1e}, "
                f"{'within' if abs(r2 - engine_r2) <= 1e-4 else 'NOT within'} 1e-4)"
                for name, r2 in peer_r2.items()
            )
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
