"""``nopelens lengthgen``: length generalization per position method, side by side with Kazemnejad et
al. 2023 (:mod:`nopelens.analyses.lengthgen`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from nopelens.analyses.lengthgen import (
    DEFAULT_METHODS,
    DEFAULT_SEEDS,
    DEFAULT_TASKS,
    METHODS,
    TASK_NAMES,
    LengthGenSettings,
    run_lengthgen,
    summarize,
)
from nopelens.analyses.lengthgen_pilot import PILOT_METHODS, PILOT_SEED, chosen_budget, run_pilot

from .options import _seeds_type, add_quiet, add_seeds, add_threads


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lengthgen",
        help="train each position method on short problems, test exact match on longer ones (Kazemnejad et al. 2023)",
        description="Length generalization side by side with Kazemnejad et al. 2023: the paper's tasks, train on "
        "sizes 1-20 and test on 21-40, its position-method choices and nopelens' defaults, over several seeds; "
        "exact match per size next to the released numbers, CIs, a verdict per claim, the out-of-distribution "
        "score through training and the attention distance between methods (Sec. 5.2). Writes tables, figures "
        "and summary.md into --out; a rerun resumes. --pilot fixes the training budget in advance from the "
        "in-distribution validation loss.",
        epilog="example: nopelens lengthgen --out runs/lengthgen --quick",
    )
    defaults = LengthGenSettings()
    parser.add_argument(
        "--out", default="runs/lengthgen", help="run folder (created; resumed if it exists; default %(default)s)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke-test settings (seconds; numbers not meaningful)"
    )
    parser.add_argument(
        "--pilot",
        action="store_true",
        help=f"instead of the comparison: train {' and '.join(PILOT_METHODS)} once per task for --steps, log the "
        "in-distribution validation loss, and print the budget its rule chooses (pilot.csv, pilot.png)",
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=list(DEFAULT_TASKS),
        choices=TASK_NAMES,
        metavar="TASK",
        help=f"tasks, of {' '.join(TASK_NAMES)} (default: {' '.join(DEFAULT_TASKS)})",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        choices=METHODS,
        metavar="METHOD",
        help=f"rows, of {' '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})",
    )
    add_seeds(parser, "each (task, method) is trained once per seed", default=DEFAULT_SEEDS)
    parser.add_argument(
        "--default-row-seeds",
        type=_seeds_type,
        default=None,
        metavar="0,1,2",
        help="seeds of the rows of nopelens' defaults (nope_scaled, t5_per_layer, rope_full), "
        "when they should use fewer (default: --seeds)",
    )
    parser.add_argument("--train-max-len", type=int, default=None, help=f"L (default {defaults.train_max_len})")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps per model (default {defaults.steps})")
    add_threads(parser)
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="models trained at once, each in a worker process on --threads threads (the numbers do "
        "not depend on it; default 1: in this process, with live bars)",
    )
    add_quiet(parser, "training progress bars or progress lines")
    parser.set_defaults(func=_run)


def _refuse_options_the_pilot_ignores(args: argparse.Namespace) -> None:
    given = [
        option
        for option, value, default in (
            ("--methods", args.methods, list(DEFAULT_METHODS)),
            ("--seeds", tuple(args.seeds), DEFAULT_SEEDS),
            ("--default-row-seeds", args.default_row_seeds, None),
            ("--jobs", args.jobs, 1),
        )
        if value != default
    ]
    if given:
        raise ValueError(
            f"--pilot trains {' and '.join(PILOT_METHODS)} once per task, on seed {PILOT_SEED}, in this process: "
            f"it takes no {', '.join(given)}"
        )


def _run(args: argparse.Namespace) -> int:
    settings = LengthGenSettings.quick() if args.quick else LengthGenSettings()
    changes = {
        k: v
        for k, v in (("train_max_len", args.train_max_len), ("steps", args.steps), ("threads", args.threads))
        if v is not None
    }
    settings = dataclasses.replace(settings, **changes)
    if args.pilot:
        _refuse_options_the_pilot_ignores(args)
        pilot = run_pilot(args.out, settings, tuple(args.tasks), progress=not args.quiet)
        levelled = pilot.groupby(["task", "method"])["levelled_step"].first()
        print(levelled.to_string(na_rep="not levelled off"))
        budget = chosen_budget(pilot)
        not_levelled = (
            ""
            if levelled.notna().all()
            else f" (not levelled off within {settings.steps} steps: "
            + ", ".join(" ".join(i) for i in levelled[levelled.isna()].index)
            + ")"
        )
        print(
            f"budget by the in-distribution rule: {'none' if budget is None else f'--steps {budget}'}"
            f"{not_levelled}; "
            f"wrote {Path(args.out) / 'pilot.csv'}, pilot.png/.svg"
        )
        return 0
    results = run_lengthgen(
        args.out,
        settings,
        tuple(args.tasks),
        tuple(args.methods),
        args.seeds,
        progress=not args.quiet,
        default_row_seeds=args.default_row_seeds,
        jobs=args.jobs,
    )
    summary = summarize(results, settings.n_symbols)
    columns = [
        "task",
        "method",
        "seeds",
        "exact_match_longer",
        "ci_low",
        "ci_high",
        "released",
        "exact_match_in_distribution",
    ]
    print(summary[columns].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.quick:
        print("quick mode: a smoke test at toy size; these numbers are not comparable with the released ones")
    print(
        f"wrote {Path(args.out) / 'summary.md'}, lengthgen.csv, curve.csv, summary.csv, claims.csv, "
        "attention_distance.csv, distance_claims.csv and figures"
    )
    return 0
