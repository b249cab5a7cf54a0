"""``nopelens compare haviv``: nopelens' text models side by side with Haviv et al. 2022
(:mod:`nopelens.analyses.haviv`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from nopelens.analyses.haviv import HAVIV_MODELS, HavivSettings, compare_haviv
from nopelens.analyses.haviv_figure import summary_markdown, write_report

from .options import add_quiet, add_seeds, seed_type

PAPERS = ("haviv",)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="side by side with a paper: Haviv et al. 2022's position probe across NoPE, learned, sinusoidal, "
        "ALiBi and RoPE",
        description="Probe every residual layer of each model with ridge regression (ours) and with "
        "Haviv et al. 2022's 2-layer MLP classifier (its argmax MAD), both as MAD/chance with 95 % CIs "
        "and no-information floors (the mean over --seeds training seeds, CIs over the runs and windows), next to the "
        "paper's released per-layer values at the same fraction "
        "of depth; validation bits per byte next to the paper's Table 1; the NoPE model at shorter "
        "windows; a verdict per claim. Writes haviv.csv, seeds.csv, losses.csv, context.csv, training.csv, claims.csv, "
        "haviv.md, summary.md, haviv.png/.svg and training.png/.svg into --out, stamped by haviv.json; "
        "a rerun resumes.",
        epilog="example: nopelens compare haviv --models text-nope-4l,text-rope-4l --out runs/haviv",
    )
    parser.add_argument("paper", choices=PAPERS, help="the paper to compare with")
    parser.add_argument(
        "--models",
        type=_models,
        default=None,
        help=f"comma-separated model specs (default: the comparison zoo, {', '.join(HAVIV_MODELS)})",
    )
    parser.add_argument(
        "--out", default="runs/haviv", help="run folder (created; resumed if it exists; default %(default)s)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny settings for a smoke test (numbers not meaningful); default models text-nope-4l,text-rope-4l",
    )
    parser.add_argument("--n-sequences", type=int, default=None, help="validation windows per model (default 100)")
    parser.add_argument(
        "--memory-mib",
        type=int,
        default=None,
        help="memory the kept features may take, in MiB (default 256): sets how many windows are kept",
    )
    parser.add_argument(
        "--contexts",
        type=_lengths,
        default=None,
        help="window lengths in bytes of the NoPE context-length axis (default 64,128,256)",
    )
    parser.add_argument(
        "--seed", type=seed_type, default=None, help="seed of windows, folds, probes, bootstrap (default 0)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="models (and window lengths) measured at once, each in a worker process on one thread "
        "(the numbers do not depend on it; default 1: in this process)",
    )
    add_seeds(
        parser,
        "each zoo model at each seed (its own trained model); with two or more, each curve is their "
        "mean, with a CI over the training runs and the windows",
        default=(0,),
    )
    add_quiet(parser, "progress lines")
    parser.set_defaults(func=_run)


def _models(text: str) -> tuple[str, ...]:
    models = tuple(spec.strip() for spec in text.split(",") if spec.strip())
    if not models:
        raise argparse.ArgumentTypeError(f"no model in {text!r}")
    return models


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"window lengths are comma-separated integers, got {text!r}") from None


def _run(args: argparse.Namespace) -> int:
    settings = (
        HavivSettings.quick(*([args.models] if args.models else []))
        if args.quick
        else HavivSettings(**({"models": args.models} if args.models else {}))
    )
    changes = {
        key: value
        for key, value in (
            ("n_sequences", args.n_sequences),
            ("memory_mib", args.memory_mib),
            ("contexts", args.contexts),
            ("seed", args.seed),
            ("train_seeds", args.seeds),
        )
        if value is not None
    }
    settings = dataclasses.replace(settings, **changes)
    say = (lambda line: None) if args.quiet else (lambda line: print(f"nopelens compare: {line}", flush=True))
    tables = compare_haviv(args.out, settings, say, jobs=args.jobs)
    write_report(args.out, tables, quick=args.quick)
    print(summary_markdown(tables))
    print(f"wrote into {Path(args.out)}:")
    print("  haviv.csv, seeds.csv, losses.csv, context.csv, training.csv, claims.csv, haviv.md, summary.md,")
    print("  haviv.png/.svg, training.png/.svg")
    return 0
