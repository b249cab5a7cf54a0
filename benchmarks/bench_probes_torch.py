"""Benchmark: probe fitting for wide activations (d_model 2048, 50,000 samples) in torch, on CPU and
on an accelerator when there is one, against scikit-learn.

Features are synthetic, ``[n_samples, d_model]`` float32 (a wide model's residual stream is too
slow to produce on a laptop): Gaussian features with a different scale per column, plus a weak
linear code of the position in 64-token sequences. What is timed, side by side in one run:

- **floor**: one Gram product ``X^T X`` of the whole matrix, float64 on CPU (and float32/float64
  on the accelerator);
- **ours**: :func:`nopelens.probes.fitting.fit_folds` (5-fold GroupKFold by sequence, ridge with
  the grouped inner CV over 28 penalties) with ``device="cpu"`` (float64) and, if CUDA is
  available, ``device="cuda"`` in float64 and float32;
- **scikit-learn**: ``Pipeline(StandardScaler, Ridge(alpha))`` once per outer fold at the penalty
  our inner CV chose -- scikit-learn's least work for the same folds, with no penalty search at
  all (a grid search over 28 penalties x 4 inner folds costs about 112 times more).

Runs as is on a machine with a GPU; CUDA is optional and nothing in CI needs it:

    python benchmarks/bench_probes_torch.py                   # full size
    python benchmarks/bench_probes_torch.py --samples 10000 --d-model 512   # a quick look

Not a test: it prints measured numbers and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from nopelens.probes import sequence_splits
from nopelens.probes.fitting import fit_folds


def synthetic(n_samples: int, d_model: int, seed: int):
    rng = np.random.default_rng(seed)
    position = np.arange(n_samples) % 64
    groups = np.arange(n_samples) // 64
    X = rng.standard_normal((n_samples, d_model), dtype=np.float32)
    X *= rng.uniform(0.1, 10, d_model).astype(np.float32)
    X += np.outer(position / 64, rng.standard_normal(d_model)).astype(np.float32)
    return X, position.astype(np.float64), groups


def timed(fn, sync: bool = False):
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--skip-sklearn", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        threadpool_limits(args.threads)
    X, y, groups = synthetic(args.samples, args.d_model, args.seed)
    X64np = X.astype(np.float64)  # scikit-learn computes in the dtype it is given; ours in float64
    splits = sequence_splits(groups, 5)
    cuda = torch.cuda.is_available()
    print(
        f"X {X.shape} float32, 5-fold GroupKFold; torch {torch.__version__}, {torch.get_num_threads()} CPU "
        f"thread(s); CUDA: {torch.cuda.get_device_name() if cuda else 'not available'}; load average {os.getloadavg()}"
    )
    X64 = torch.as_tensor(X, dtype=torch.float64)
    rows = []
    _, floor, cpu = timed(lambda: X64.numpy().T @ X64.numpy())
    rows.append(("floor: X^T X, CPU float64", floor, cpu))
    ours, wall, cpu = timed(lambda: fit_folds(X, [y], groups, splits, "regression", device="cpu"))
    rows.append(("ours: fit_folds, CPU float64", wall, cpu))
    if cuda:
        for dtype in (torch.float64, torch.float32):
            Xg = torch.as_tensor(X, device="cuda", dtype=dtype)
            timed(lambda: Xg.T @ Xg, sync=True)  # warm-up
            _, wall, cpu = timed(lambda: Xg.T @ Xg, sync=True)
            rows.append((f"floor: X^T X, CUDA {str(dtype)[6:]}", wall, cpu))
            fit_folds(
                X[:4096],
                [y[:4096]],
                groups[:4096],
                sequence_splits(groups[:4096], 5),
                "regression",
                device="cuda",
                compute_dtype=dtype,
            )  # warm-up
            gpu, wall, cpu = timed(
                lambda: fit_folds(X, [y], groups, splits, "regression", device="cuda", compute_dtype=dtype), sync=True
            )
            rows.append((f"ours: fit_folds, CUDA {str(dtype)[6:]}", wall, cpu))
            print(
                f"CUDA {str(dtype)[6:]} vs CPU float64: max |difference| of predictions "
                f"{np.abs(gpu.predictions[0] - ours.predictions[0]).max():.2e}"
            )
    if not args.skip_sklearn:

        def sklearn_fixed():
            out = []
            for k, (fit, score) in enumerate(splits):
                model = make_pipeline(StandardScaler(), Ridge(alpha=ours.alphas[0][k])).fit(X64np[fit], y[fit])
                out.append(model.predict(X64np[score]))
            return np.concatenate(out)

        pred, wall, cpu = timed(sklearn_fixed)
        rows.append(("sklearn: 5 fixed-penalty fits", wall, cpu))
        print(f"max |ours - scikit-learn| at the same penalties: {np.abs(pred - ours.predictions[0]).max():.2e}")
    print(f"{'what':34s} {'wall s':>8s} {'cpu s':>8s} {'x CPU floor':>11s}")
    for name, wall, cpu in rows:
        print(f"{name:34s} {wall:8.3f} {cpu:8.3f} {wall / floor:11.1f}")
    print(f"chosen penalties per fold: {ours.alphas[0].tolist()}; load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
