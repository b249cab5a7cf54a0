"""``nopelens extreme-tokens MODEL``: what Guo et al. 2024 measure on the Bigram-Backcopy task
(:mod:`nopelens.analyses.extreme_tokens`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from nopelens.analyses import extreme_tokens
from nopelens.analyses.audit.report import by_reason
from nopelens.analyses.report import rounded_text
from nopelens.analyses.runs import refuse_other_runs, slug
from nopelens.analyses.subjects import fixed_length, resolve
from nopelens.models.io import write_csv_atomic
from nopelens.models.threads import one_thread

from .options import MODEL_HELP, add_quiet, seed_type

DEFAULT_SEQ_LEN = 64


def run(args: argparse.Namespace) -> int:
    if isinstance(args.n_boot, bool) or args.n_boot < 1:
        raise ValueError(f"--n-boot must be a positive integer, got {args.n_boot}")
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
    elif (why := fixed_length(args.model)) is not None:
        raise ValueError(f"--seq-len does not apply: {why}; leave --seq-len out")
    if args.out is not None:
        refuse_other_runs(args.out, "extreme-tokens")
    with one_thread():
        subject = resolve(
            args.model, args.n_sequences, args.seq_len, args.seed, not args.quiet, 30 if args.quick else None
        )
        tables = extreme_tokens.measure(subject, args.n_boot, args.seed)
    out = Path(args.out or f"runs/extreme-tokens-{slug(args.model)}")
    for name, table in tables.items():
        write_csv_atomic(table, out / f"{name}.csv")
    print(format_report(tables, subject.has_bos))
    print(f"\nwrote {out}/heads.csv, norms.csv, ablation.csv")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "extreme-tokens",
        help="active-dormant heads, value-state drains and residual-state peaks (Guo et al. 2024)",
        description="Measure on a model what Guo et al. 2024 measure on the Bigram-Backcopy task: per head the "
        "attention on BOS and on the previous token for trigger and non-trigger queries, the first token's value and "
        "residual norms, and the loss per query class under the sink ablations of `nopelens intervene`.",
        epilog="examples:\n  nopelens extreme-tokens bb-nope-3l\n  nopelens extreme-tokens text-nope-4l",
    )
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("--out", help="output folder (default runs/extreme-tokens-<model>)")
    parser.add_argument("--n-sequences", type=int, default=80, help="evaluation sequences (default 80, as the sweep)")
    parser.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}; synthetic-task "
        "models are read at their longest training length)",
    )
    parser.add_argument("--n-boot", type=int, default=200, help="bootstrap replicates (default 200)")
    parser.add_argument("--seed", type=seed_type, default=0, help="seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="zoo models trained for 30 steps (smoke tests)")
    add_quiet(parser)
    parser.set_defaults(func=run)


def format_report(tables: dict[str, pd.DataFrame], has_bos: bool = True) -> str:
    """The three tables as text, rounded; an undefined number reads ``n/a`` (the norm ratio when the
    other tokens' states are zero, the accuracy of the task's floor, which is a loss only). Without
    ``has_bos`` the first token is named an ordinary one, not BOS; the blocks a read skips are listed
    with the reason."""
    read = {name: tables[name][tables[name]["status"] != "not_applicable"] for name in ("heads", "norms")}
    heads = (
        read["heads"]
        .reindex(
            columns=["block", "head", "query_class", "n_queries", "first_mass", "previous_mass", "dormant", "active"]
        )
        .astype({"head": int, "n_queries": int})
    )
    norms = read["norms"][["site", "head", "first_norm", "other_norm", "ratio"]].astype({"head": int})
    ablation = tables["ablation"]
    measured = ablation[ablation["status"] == "measured"]
    shown = measured
    if len(measured):
        label = measured["condition"] + measured["ablated_block"].map(
            lambda b: "" if pd.isna(b) else f", block {int(b)}"
        )
        shown = measured.assign(condition=label).pivot_table(
            index="condition", columns="query_class", values=["loss", "accuracy"], sort=False
        )
    first = (
        "the first token (BOS)" if has_bos else "the first token (no BOS: the sequences start with an ordinary token)"
    )
    parts = [
        f"attention on {first} and on the previous token, per head and query class",
        rounded_text(heads).to_string(index=False),
        "\nnorm of the first token's state over the other tokens' (value: hook_v per head; residual per layer)",
        rounded_text(norms).to_string(index=False),
        "\nloss (nats) and accuracy per query class: clean, the task's floor, and each sink ablation per block",
        rounded_text(shown).to_string() if len(shown) else "(nothing measured)",
    ]
    for name, what in (("heads", "attention (hook_pattern)"), ("norms", "value norms (hook_v)")):
        unread = tables[name][tables[name]["status"] == "not_applicable"]
        if len(unread):
            reasons = dict(zip(map(int, unread["block"]), unread["note"]))
            parts.append(f"not applicable: {what} on {by_reason(reasons, 'blocks')}")
    for _, r in read["norms"][read["norms"]["note"].fillna("") != ""].iterrows():
        parts.append(
            f"ratio n/a at {r['site']}" + ("" if pd.isna(r["head"]) else f" head {int(r['head'])}") + f": {r['note']}"
        )
    refused = ablation[ablation["status"] == "not_applicable"]
    for _, r in refused.iterrows():
        where = "" if pd.isna(r.get("ablated_block", np.nan)) else f" in block {int(r['ablated_block'])}"
        parts.append(f"not applicable: {r['condition']}{where}: {r['note']}")
    return "\n".join(parts)
