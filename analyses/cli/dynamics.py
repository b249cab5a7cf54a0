"""``nopelens dynamics MODEL``: position and attention sinks through training (:mod:`nopelens.analyses.dynamics`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nopelens.analyses import dynamics
from nopelens.analyses.command_figures import dynamics_figure
from nopelens.analyses.figures import save_figure
from nopelens.models import zoo
from nopelens.models.io import write_text_atomic

from .options import add_quiet, seed_type


def run(args: argparse.Namespace) -> int:
    settings = dynamics.DynamicsSettings(
        model=args.model,
        n_checkpoints=args.checkpoints,
        train_seed=args.train_seed,
        quick_steps=30 if args.quick else None,
        **{k: getattr(args, k) for k in ("n_sequences", "n_boot", "seed") if getattr(args, k) is not None},
    )
    out = Path(args.out or f"runs/dynamics-{args.model}{'-quick' if args.quick else ''}")
    table = dynamics.run(settings, out, progress=not args.quiet)
    print(render(table, settings.model, out, zoo.recipe(settings.model).config.position_name))
    print(f"wrote {out}/dynamics.csv, summary.md, dynamics.png; checkpoints in {out}/checkpoints")
    return 0


def render(table, name: str, out: Path, position: str | None = None) -> str:
    """Write the run folder's ``summary.md`` and ``dynamics.png`` of ``table``
    (:func:`~nopelens.analyses.dynamics.run`'s; ``position``: the model's position method, for its
    colour) and return the summary."""
    summary = dynamics.summary_markdown(table, name)
    write_text_atomic(out / "summary.md", summary)
    save_figure(dynamics_figure(table, name, dynamics.THRESHOLD, position), out / "dynamics", formats=("png",))
    return summary


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "dynamics",
        help="follow position probes and attention sinks through training",
        description="Retrain a zoo model from its recipe, keep checkpoints at log-spaced steps and measure each "
        "with the sweep's probes: absolute-index R² per layer, the head-score read of i − j, the sink rate, the loss.",
        epilog="examples:\n  nopelens dynamics bb-nope-3l\n  nopelens dynamics text-nope-4l --checkpoints 10",
    )
    parser.add_argument("model", help="a zoo name (nopelens train --list)")
    parser.add_argument("--out", help="run folder (default runs/dynamics-<model>); reruns resume")
    parser.add_argument("--checkpoints", type=int, default=12, help="checkpoints incl. step 0 (default 12)")
    parser.add_argument("--train-seed", type=int, default=0, help="training seed of the recipe (default 0)")
    parser.add_argument("--n-sequences", type=int, help="evaluation sequences (default 40)")
    parser.add_argument("--n-boot", type=int, help="bootstrap replicates (default 200)")
    parser.add_argument("--seed", type=seed_type, help="seed of the evaluation sequences and probes (default 0)")
    parser.add_argument("--quick", action="store_true", help="train 30 steps only (smoke test)")
    add_quiet(parser)
    parser.set_defaults(func=run)
