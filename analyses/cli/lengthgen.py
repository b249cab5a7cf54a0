"""``nopelens lengthgen``: length generalization per position method (:mod:`nopelens.analyses.lengthgen`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from nopelens.analyses.lengthgen import METHODS, TASK_NAMES, LengthGenSettings, run_lengthgen, summarize

from .options import add_quiet, add_seeds, add_threads


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lengthgen",
        help="train each position method on short sequences, test exact match on longer ones",
        description="Length generalization (Kazemnejad et al. 2023, scaled down): for the repeat "
        "and copy tasks, train each position method on lengths 1..L over several seeds and "
        "measure exact match at 1..2L. Writes lengthgen.csv, summary.csv and a plot (PNG+SVG) "
        "into --out; a rerun resumes.",
        epilog="example: nopelens lengthgen --out runs/lengthgen --quick",
    )
    defaults = LengthGenSettings()
    parser.add_argument(
        "--out", default="runs/lengthgen", help="run folder (created; resumed if it exists; default %(default)s)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke-test settings (numbers not meaningful)")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=list(TASK_NAMES),
        choices=TASK_NAMES,
        help="tasks to train and test (default: all)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        help="position methods to compare (default: all)",
    )
    add_seeds(parser, "each (task, method) is trained once per seed", default=(0, 1, 2))
    parser.add_argument("--train-max-len", type=int, default=None, help=f"L (default {defaults.train_max_len})")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps per model (default {defaults.steps})")
    add_threads(parser)
    add_quiet(parser, "training progress bars or progress lines")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    settings = LengthGenSettings.quick() if args.quick else LengthGenSettings()
    changes = {
        k: v
        for k, v in (("train_max_len", args.train_max_len), ("steps", args.steps), ("threads", args.threads))
        if v is not None
    }
    settings = dataclasses.replace(settings, **changes)
    results = run_lengthgen(
        args.out, settings, tuple(args.tasks), tuple(args.methods), args.seeds, progress=not args.quiet
    )
    summary = summarize(results)
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {Path(args.out) / 'lengthgen.csv'}, summary.csv, lengthgen.png/.svg")
    return 0
