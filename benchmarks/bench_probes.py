"""Benchmark: absolute-index probes on every layer of a 4-layer, d_model-128 decoder, 20 000 samples.

For each residual site (layers 0..4) and each target (64-class position, position as a value) it
times one site-target fit with 5-fold GroupKFold by sequence (the cross-validated fit itself,
without controls or bootstrap) for our default probes (``StandardScaler`` + shrinkage LDA for
classes, ``StandardScaler`` + ``RidgeCV`` for values) and for ``StandardScaler`` +
``RidgeClassifier``, and in the same run a plain, unscaled ``LogisticRegression`` (scikit-learn
defaults) on the same folds, printing the speed ratio and the accuracy difference (points). Run on 2 cores:

    taskset -c 0,1 python benchmarks/bench_probes.py --threads 2

On a machine shared with other jobs, use ``--threads 1``: two OpenBLAS threads on oversubscribed
cores spin-wait, and we measured one 16 000 x 128 LDA fit going from 16 ms (1 thread) to 650 ms
(2 threads) at a load average of 4 on 2 cores. Wall and CPU seconds are both printed.

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
from threadpoolctl import threadpool_limits

from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import collect, make_probe, out_of_fold_predictions, resid_sites, sequence_splits


def build_activations(position: str, n_samples: int, seed: int, init_std: float = 0.02):
    n_ctx = 64
    cfg = DecoderConfig(d_vocab=512, n_ctx=n_ctx, n_layers=4, d_model=128, n_heads=4, position=position,
                        init_std=init_std)
    model = Decoder(cfg, seed=seed)
    n_seq = -(-n_samples // n_ctx)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.d_vocab, (n_seq, n_ctx), generator=generator)
    mask = torch.ones_like(tokens)
    mask.view(-1)[n_samples:] = 0  # right-pad the last sequence so there are exactly n_samples tokens
    return collect(model, tokens, resid_sites(cfg.n_layers), attention_mask=mask, batch_size=64)


def timed(fn):
    """(result, wall seconds, CPU seconds of this process): on a shared machine CPU time shows the
    work done; wall time also counts waiting for the cores."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--position", default="sinusoidal", help="position method of the untrained model")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-logistic", action="store_true", help="time only our probes")
    parser.add_argument("--init-std", type=float, default=0.02,
                        help="weight init std; larger token embeddings hide the sinusoidal signal, so the "
                             "accuracies are not all 1.0 and the comparison has something to compare")
    parser.add_argument("--threads", type=int, default=2, help="BLAS/OpenMP/torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    acts = build_activations(args.position, args.samples, args.seed, args.init_std)
    y, groups = acts.position, acts.sequence_id
    splits = sequence_splits(groups, n_splits=5)
    print(f"{args.position} decoder (init std {args.init_std}), 4 layers, d_model 128: {acts.n_samples} samples, "
          f"{acts.n_sequences} sequences, 5-fold GroupKFold, {args.threads} thread(s), "
          f"load average {os.getloadavg()}")
    print(f"{'site':26s} {'probe':22s} {'wall s':>7s} {'cpu s':>7s} {'score':>7s} {'x faster (wall)':>15s} {'d acc (pt)':>10s}")
    for site in acts.acts:
        X = acts.features(site)
        (index, pred), wall, cpu = timed(lambda: out_of_fold_predictions(make_probe("regression"), X, y, splits))
        r2 = 1 - np.sum((y[index] - pred) ** 2) / np.sum((y[index] - y[index].mean()) ** 2)
        print(f"{site:26s} {'RidgeCV (R^2)':22s} {wall:7.3f} {cpu:7.3f} {r2:7.3f}")
        results = {}
        for name, classifier in (("PooledLDA (default)", "lda"), ("RidgeClassifier", "ridge")):
            (index, pred), wall, cpu = timed(
                lambda: out_of_fold_predictions(make_probe("classification", classifier), X, y, splits))
            results[name] = (wall, cpu, float(np.mean(pred == y[index])))
        if not args.skip_logistic:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                (index, pred), wall, cpu = timed(lambda: out_of_fold_predictions(LogisticRegression(), X, y, splits))
            reference = (wall, cpu, float(np.mean(pred == y[index])))
        for name, (wall, cpu, accuracy) in results.items():
            line = f"{site:26s} {name + ' acc':22s} {wall:7.3f} {cpu:7.3f} {accuracy:7.3f}"
            if not args.skip_logistic:
                line += f" {reference[0] / wall:15.1f} {100 * (accuracy - reference[2]):10.2f}"
            print(line)
        if not args.skip_logistic:
            print(f"{site:26s} {'LogisticRegression acc':22s} {reference[0]:7.3f} {reference[1]:7.3f} {reference[2]:7.3f}",
                  flush=True)
    print(f"load average during the run: {os.getloadavg()}")


if __name__ == "__main__":
    main()
