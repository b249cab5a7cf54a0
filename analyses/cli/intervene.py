"""``nopelens intervene MODEL``: sink ablation, index-direction interventions and position patching
(:mod:`nopelens.analyses.intervene`; the run folder is described in :mod:`nopelens.analyses.intervene.run`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nopelens.analyses.command_figures import intervention_figure
from nopelens.analyses.figures import save_figure
from nopelens.analyses.intervene import SINK_MODES, InterveneSettings, run_intervene
from nopelens.analyses.report import rounded_text
from nopelens.analyses.runs import slug

from .options import MODEL_HELP, add_quiet, seed_type


def run(args: argparse.Namespace) -> int:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes:
        raise ValueError(f"--modes lists no sink ablation; choose from {', '.join(SINK_MODES)}")
    settings = InterveneSettings(
        model=args.model,
        modes=modes,
        shift=args.shift,
        quick_steps=30 if args.quick else None,
        **{k: getattr(args, k) for k in ("n_sequences", "seq_len", "seed", "n_boot") if getattr(args, k) is not None},
    )
    out = Path(args.out or f"runs/intervene-{slug(args.model)}")
    tables = run_intervene(settings, out, progress=not args.quiet)
    save_figure(intervention_figure(tables, tables["sink_probes"]["model"].iloc[0]), out / "intervene")
    columns = [
        c
        for c in (
            "condition",
            "ablated_block",
            "abs_r2_clean",
            "abs_r2",
            "abs_acc_clean",
            "abs_acc",
            "qk_r2_clean",
            "qk_r2",
            "loss_delta",
            "exact_match_delta",
        )
        if c in tables["summary"]
    ]
    summary = tables["summary"][columns]
    print(rounded_text(summary).to_string(index=False))
    if "qk_r2" in summary and summary["qk_r2"].isna().any():
        print(
            "qk_r2 n/a: the q·k read of block l + 1 is taken after ablating block l; the last block has none after "
            "it, nor has a RoPE block where no hook that fires holds q and k rotated"
        )
    refused = tables["sink_behavior"]
    if "status" in refused:
        for _, row in refused[refused["status"] == "not_applicable"].iterrows():
            print(f"not applicable: {row['condition']} in block {int(row['ablated_block'])}: {row['note']}")
    print(
        f"\nwrote {out}/summary.csv, sink_probes.csv, sink_behavior.csv, directions.csv, patching.csv, "
        "intervene.png and .svg; its settings in intervene.json"
    )
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "intervene",
        help="causal tests: does the probed position come from the attention sink, and is it used?",
        description="Ablate the first token in each block (remove its key, or mean its value) and re-probe later "
        "layers; shift or project out the probe's index direction; patch states from a shifted copy.",
        epilog="examples:\n  nopelens intervene circuit\n  nopelens intervene text-nope-4l --out runs/iv-nope",
    )
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("--out", help="run folder (default runs/intervene-<model>); reruns resume")
    parser.add_argument("--modes", default=",".join(SINK_MODES), help="sink ablations, comma list (default both)")
    parser.add_argument("--shift", type=int, default=4, help="k of the index-direction shift (default 4)")
    parser.add_argument("--n-sequences", type=int, help="evaluation sequences (default 80, as the sweep)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 64)")
    parser.add_argument("--n-boot", type=int, help="bootstrap replicates (default 200)")
    parser.add_argument("--seed", type=seed_type, help="seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="zoo models trained for 30 steps (smoke tests)")
    add_quiet(parser, "progress lines")
    parser.set_defaults(func=run)
