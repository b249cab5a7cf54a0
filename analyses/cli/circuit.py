"""``nopelens circuit``: build a hand-set circuit or run a seed demo, print its checks, draw its figure
(:mod:`nopelens.analyses.circuit_checks`).

Each subject writes ``<subject>.png``, ``<subject>.svg`` and ``<subject>_checks.csv`` into ``--out``
(atomically: temp file, then rename) and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from nopelens.analyses.circuit_checks import RUNNERS, SUBJECTS, CircuitSettings
from nopelens.analyses.figures import save_figure
from nopelens.circuits.counter import CONSTRUCTIONS
from nopelens.models.io import write_csv_atomic

from .options import seed_type


def _print_checks(table: pd.DataFrame) -> None:
    for row in table.itertuples():
        if row.bound is None or pd.isna(row.bound):
            print(f"  {row.check:<40} {row.value}")
            continue
        sign = "<=" if row.kind == "max" else ">"
        verdict = "ok" if row.passed else "FAIL"
        print(f"  {row.check:<40} {float(row.value):.6g}  ({sign} {row.bound:g}: {verdict})")


def save_table(table: pd.DataFrame, out: Path, stem: str) -> Path:
    return write_csv_atomic(table, out / f"{stem}.csv")


def run(args: argparse.Namespace) -> int:
    if args.n_ctx < 2:
        raise ValueError(f"--n-ctx must be >= 2, got {args.n_ctx}")
    out = Path(args.out)
    settings = CircuitSettings(
        n_ctx=args.n_ctx,
        slope=args.slope,
        sharpness=args.sharpness,
        construction=args.construction,
        d_vocab=args.d_vocab,
        seed=args.seed,
    )
    table, fig = RUNNERS[args.subject](settings)
    stem = args.subject.replace("-", "_")
    if args.subject in ("counter", "distance", "previous-token"):
        _print_checks(table)
    paths = save_figure(fig, out / stem) + [save_table(table, out, f"{stem}_checks")]
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = table[table.passed == False]  # noqa: E712 (None means: no bound, informational)
    if len(failed):
        print(f"FAILED: {', '.join(failed.check)}")
        return 1
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "circuit",
        help="hand-built NoPE circuits (Kazemnejad et al. 2023) and seed demos, with checks and a figure",
        description="Build a hand-set circuit or run a seed demo, print its checks, draw its figure."
        + " Subjects: counter, distance, previous-token (circuits) and equivariance, mask-table (seed demos).",
        epilog="example: nopelens circuit distance --n-ctx 128 --slope 0.25 --out runs/circuit",
    )
    parser.add_argument(
        "subject",
        choices=SUBJECTS,
        help="a circuit (counter, distance, previous-token) or a seed demo (equivariance, mask-table)",
    )
    parser.add_argument("--n-ctx", type=int, default=64, help="positions the circuit covers (default 64)")
    parser.add_argument("--slope", type=float, default=0.5, help="ALiBi slope m of the distance head (default 0.5)")
    parser.add_argument("--sharpness", type=float, default=10.0, help="c of the previous-token head (default 10)")
    parser.add_argument("--construction", choices=CONSTRUCTIONS, default="steps", help="counter MLP (default steps)")
    parser.add_argument("--d-vocab", type=int, default=8, help="vocabulary size including BOS (default 8)")
    parser.add_argument("--seed", type=seed_type, default=0, help="seed of the random tokens / demo inputs")
    parser.add_argument("--out", default="runs/circuit", help="folder for figures and check tables")
    parser.set_defaults(func=run)
