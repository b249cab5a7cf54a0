"""Benchmark: absolute-index probes on every layer of a 4-layer, d_model-128 decoder, 20 000 samples.

For each residual site (layers 0..4) and each target (64-class position, position as a value) it
times one site-target fit with 5-fold GroupKFold by sequence (the cross-validated fit itself,
without controls or bootstrap) for our default probes (``StandardScaler`` + shrinkage LDA for
classes, ``StandardScaler`` + ``RidgeCV`` for values) and for ``StandardScaler`` +
``RidgeClassifier``, and in the same run a plain, unscaled ``LogisticRegression`` (scikit-learn
defaults) on the same folds, printing the speed ratio and the accuracy difference (points). Run on 2 cores:

    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 python benchmarks/bench_probes.py

Not a test: it prints measured numbers and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import collect, make_probe, out_of_fold_predictions, resid_sites, sequence_splits


def build_activations(position: str, n_samples: int, seed: int):
    n_ctx = 64
    cfg = DecoderConfig(d_vocab=512, n_ctx=n_ctx, n_layers=4, d_model=128, n_heads=4, position=position)
    model = Decoder(cfg, seed=seed)
    n_seq = -(-n_samples // n_ctx)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.d_vocab, (n_seq, n_ctx), generator=generator)
    mask = torch.ones_like(tokens)
    mask.view(-1)[n_samples:] = 0  # right-pad the last sequence so there are exactly n_samples tokens
    return collect(model, tokens, resid_sites(cfg.n_layers), attention_mask=mask, batch_size=64)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--position", default="sinusoidal", help="position method of the untrained model")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-logistic", action="store_true", help="time only our probes")
    args = parser.parse_args()
    torch.set_num_threads(2)
    acts = build_activations(args.position, args.samples, args.seed)
    y, groups = acts.position, acts.sequence_id
    splits = sequence_splits(groups, n_splits=5)
    print(f"{args.position} decoder, 4 layers, d_model 128: {acts.n_samples} samples, "
          f"{acts.n_sequences} sequences, 5-fold GroupKFold")
    print(f"{'site':26s} {'probe':22s} {'seconds':>8s} {'score':>7s} {'x faster':>9s} {'d acc (pt)':>10s}")
    for site in acts.acts:
        X = acts.features(site)
        (index, pred), seconds = timed(lambda: out_of_fold_predictions(make_probe("regression"), X, y, splits))
        r2 = 1 - np.sum((y[index] - pred) ** 2) / np.sum((y[index] - y[index].mean()) ** 2)
        print(f"{site:26s} {'RidgeCV (R^2)':22s} {seconds:8.3f} {r2:7.3f}")
        results = {}
        for name, classifier in (("LDA (default)", "lda"), ("RidgeClassifier", "ridge")):
            (index, pred), seconds = timed(lambda: out_of_fold_predictions(make_probe("classification", classifier), X, y, splits))
            results[name] = (seconds, float(np.mean(pred == y[index])))
        if not args.skip_logistic:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                (index, pred), seconds = timed(lambda: out_of_fold_predictions(LogisticRegression(), X, y, splits))
            reference = (seconds, float(np.mean(pred == y[index])))
        for name, (seconds, accuracy) in results.items():
            line = f"{site:26s} {name + ' (acc)':22s} {seconds:8.3f} {accuracy:7.3f}"
            if not args.skip_logistic:
                line += f" {reference[0] / seconds:9.1f} {100 * (accuracy - reference[1]):10.2f}"
            print(line)
        if not args.skip_logistic:
            print(f"{site:26s} {'LogisticRegression':22s} {reference[0]:8.3f} {reference[1]:7.3f}", flush=True)
    print(f"load average during the run: {os.getloadavg()}")


if __name__ == "__main__":
    main()
