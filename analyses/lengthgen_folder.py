"""Reading a ``nopelens lengthgen`` run folder back (:mod:`~nopelens.analyses.lengthgen`): which
runs of ``lengthgen.csv`` and ``curve.csv`` are whole and sound, so that a rerun keeps them and
measures the others again. Every cell is checked (pandas reads a column with one bad cell as text),
and a line cut short at the end of a file is left out; each such finding is one line on stderr."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from . import kazemnejad

TASK_NAMES = tuple(kazemnejad.PAPER_TASKS)
METHODS = tuple(kazemnejad.VARIANTS)

RESULT_COLUMNS = ("task", "method", "seed", "length", "n", "exact_match", "token_accuracy", "loss", "in_distribution")
"""Columns a finished run's rows of ``lengthgen.csv`` must have (:data:`RUN_COLUMNS` too, where present)."""

RUN_COLUMNS = ("train_max_len", "final_train_loss", "train_seconds", "eval_seconds")
"""Per-run columns, checked where the file has them (folders from before they were written lack some)."""


def _finite_nonnegative(values: pd.Series) -> pd.Series:
    return (values >= 0) & np.isfinite(values)


def valid_rows(results: pd.DataFrame, train_max_len: int) -> pd.DataFrame:
    """The rows of ``lengthgen.csv`` that hold what a run writes, parsed: a known task and method, an
    integer seed >= 0, length >= 1 and n >= 1, an exact match and a token accuracy in [0, 1], a
    finite loss >= 0, ``in_distribution`` a boolean equal to ``length <= train_max_len``, and where
    present ``train_max_len`` equal to the run's and finite losses and seconds >= 0. pandas reads a
    column with one bad cell as text, so each is parsed here."""
    labels = ("task", "method", "in_distribution")
    numeric = [c for c in (*RESULT_COLUMNS, *RUN_COLUMNS) if c in results and c not in labels]
    number = {column: pd.to_numeric(results[column], errors="coerce") for column in numeric}
    flag = results["in_distribution"].map(
        lambda cell: {"true": True, "false": False, "1": True, "0": False}.get(str(cell).strip().lower())
    )

    def whole(values: pd.Series, low: int) -> pd.Series:
        return (values == values.round()) & values.between(low, 2**62)

    valid = (
        results["task"].isin(TASK_NAMES)
        & results["method"].isin(METHODS)
        & whole(number["seed"], 0)
        & whole(number["length"], 1)
        & whole(number["n"], 1)
        & number["exact_match"].between(0, 1)
        & number["token_accuracy"].between(0, 1)
        & _finite_nonnegative(number["loss"])
        & flag.notna()
        & (flag == (number["length"] <= train_max_len))
    )
    if "train_max_len" in results:
        valid &= number["train_max_len"] == train_max_len
    for column in ("final_train_loss", "train_seconds", "eval_seconds"):
        if column in results:
            valid &= _finite_nonnegative(number[column])
    parsed = results.assign(**number, in_distribution=flag)
    whole_numbers = {c: int for c in ("seed", "length", "n", "train_max_len") if c in parsed}
    return parsed[valid].astype({**whole_numbers, "exact_match": float, "in_distribution": bool})


def read_lines(path: Path) -> io.StringIO | None:
    """``path``'s text up to its last newline (None: no such file). Tables are written whole, each
    line ending in a newline: a cut last line (a copy or an editor stopped half-way) is dropped,
    with a line on stderr, so that its row's run counts as incomplete rather than keeping a cut
    number.

    Raises:
        UnicodeDecodeError: on bytes that are not UTF-8.
    """
    if not path.exists():
        return None
    text = path.read_bytes().decode("utf-8")
    if text and not text.endswith("\n"):
        print(f"nopelens lengthgen: {path} ends in a cut line; that line is left out", file=sys.stderr)
        text = text[: text.rfind("\n") + 1]
    return io.StringIO(text)


def read_results(path: Path, train_max_len: int) -> pd.DataFrame:
    """The finished runs in ``lengthgen.csv``: none when it is missing; when it is emptied, cannot be
    read or lacks a column (a line says so) none either, and every run is measured again. A run with a
    damaged cell (empty, not a number, out of range: :func:`valid_rows`), or whose rows do not cover
    every length ``1 .. 2 train_max_len`` (a truncated file), is left out, named, and measured again;
    the other runs are kept."""

    def measure_all_again(why: str) -> pd.DataFrame:
        print(f"nopelens lengthgen: {path} {why}; measuring every run again", file=sys.stderr)
        return pd.DataFrame()

    try:
        lines = read_lines(path)
        if lines is None:
            return pd.DataFrame()
        results = pd.read_csv(lines)
    except pd.errors.EmptyDataError:
        return measure_all_again("is empty")
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as error:
        return measure_all_again(f"cannot be read ({' '.join(str(error).split())[:200]})")
    missing = [column for column in RESULT_COLUMNS if column not in results]
    if missing:
        return measure_all_again(f"is damaged (columns {missing} missing)")
    run = ["task", "method", "seed"]
    # a row with a damaged cell is dropped; its run then lacks a length and is measured again below
    results = valid_rows(results, train_max_len)
    lengths = set(range(1, 2 * train_max_len + 1))
    complete = results.groupby(run)["length"].transform(lambda rows: set(rows) == lengths and len(rows) == len(lengths))
    for (task, method, seed), _ in results[~complete.astype(bool)].groupby(run):
        print(
            f"nopelens lengthgen: {path} holds only part of {task} {method} seed {seed} (a truncated or damaged "
            "file?); measuring it again",
            file=sys.stderr,
        )
    return results[complete.astype(bool)].reset_index(drop=True)


CURVE_COLUMNS = ["task", "method", "seed", "step", "exact_match_longer", "validation_loss"]


def read_curve(path: Path, done: set, steps: list[int]) -> tuple[pd.DataFrame, set]:
    """The rows of ``curve.csv`` of the finished runs ``done``, and the finished runs whose curve is
    missing, truncated or damaged (not one valid row per step of ``steps``: an exact match in
    [0, 1], a finite validation loss >= 0), named on stderr: those are measured again."""
    curve = pd.DataFrame(columns=CURVE_COLUMNS)
    try:
        lines = read_lines(path)
        if lines is not None:
            curve = pd.read_csv(lines)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError):
        pass
    if not set(CURVE_COLUMNS) <= set(curve.columns):
        curve = pd.DataFrame(columns=CURVE_COLUMNS)
    seed, step, exact, loss = (
        pd.to_numeric(curve[c], errors="coerce") for c in ("seed", "step", "exact_match_longer", "validation_loss")
    )
    valid = exact.between(0, 1) & _finite_nonnegative(loss) & step.isin(steps) & seed.notna()
    parsed = curve.assign(seed=seed, step=step, exact_match_longer=exact, validation_loss=loss)[valid]
    parsed = parsed.drop_duplicates(["task", "method", "seed", "step"]).astype({"seed": int, "step": int})
    whole = {run for run, rows in parsed.groupby(["task", "method", "seed"]) if len(rows) == len(steps)}
    damaged = set(done) - whole
    if damaged:
        first = " ".join(map(str, min(damaged)))
        print(
            f"nopelens lengthgen: {path} lacks or holds a damaged curve for {len(damaged)} finished "
            f"run(s) ({first}{', ...' if len(damaged) > 1 else ''}); measuring them again",
            file=sys.stderr,
        )
    return runs_in(parsed, whole & set(done))[CURVE_COLUMNS], damaged


def runs_in(table: pd.DataFrame, runs_kept: set) -> pd.DataFrame:
    """The rows of ``table`` whose (task, method, seed) is in ``runs_kept``."""
    keep = pd.Series([run in runs_kept for run in zip(table["task"], table["method"], table["seed"])], dtype=bool)
    return table[keep.to_numpy()].reset_index(drop=True)
