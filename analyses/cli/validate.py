"""``nopelens validate``: the known-answer suite (:mod:`nopelens.analyses.validate`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nopelens.analyses import validate
from nopelens.models.io import check_writable, write_csv_atomic, write_text_atomic

from .options import seed_type

REPORT = "known_answers.md"


def report_path(out: str) -> Path:
    """Where ``--out`` puts the report: a path ending in ``.md`` is the file itself, anything else
    a run folder that gets ``known_answers.md`` (and ``known_answers.csv``)."""
    return Path(out) if out.endswith(".md") else Path(out) / REPORT


def run_validate(args: argparse.Namespace) -> int:
    if args.out != "-":
        check_writable(report_path(args.out))  # before the suite runs, so a bad --out wastes no work
    table = validate.run_suite(args.seed)
    width = max(len(name) for name in table["name"])
    for row in table.itertuples():
        verdict = "pass" if row.passed else "FAIL"
        print(
            f"{row.name:<{width}}  expected {row.comparison} {row.expected:<10.6g} measured {row.measured:<12.6g} "
            f"(tolerance {row.tolerance:.3g})  {verdict}"
        )
    failed = int((~table["passed"]).sum())
    print(f"\n{len(table) - failed} of {len(table)} rows pass")
    if args.out != "-":
        command = "nopelens validate" + ("" if args.seed == validate.SEED else f" --seed {args.seed}")
        path = write_text_atomic(report_path(args.out), validate.report_markdown(table, command))
        table_path = write_csv_atomic(table, path.with_suffix(".csv"))
        print(f"wrote {path} and {table_path.name}")
    return 1 if failed else 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="the known-answer suite: models where theory fixes every number",
        description="Build small models whose answers theory fixes (untrained learned and sinusoidal positions, "
        "constant input for every attention method, the Theorem 1/2 circuit, ALiBi and RoPE score reads, "
        "hand-set sink heads, NoPE variance shrinkage), probe them with the sweep's own functions, print "
        "expected against measured with pass/fail, and write a Markdown report. Exit code 1 when a row fails. "
        "Runs on one thread in well under a minute.",
        epilog="examples:\n  nopelens validate                       # writes runs/validate/known_answers.md\n"
        "  nopelens validate --out docs            # refresh the report the README links\n"
        "  nopelens validate --seed 3 --out -",
    )
    parser.add_argument(
        "--out",
        default="runs/validate",
        help="run folder for known_answers.md and known_answers.csv (default runs/validate); a path "
        "ending in .md is the report itself; - writes none",
    )
    parser.add_argument(
        "--seed", type=seed_type, default=validate.SEED, help="seed of the weights and sequences (default 0)"
    )
    parser.set_defaults(func=run_validate)
