"""Length generalization: train on lengths <= L, test exact match on L+1 .. 2L, per position method.

The experiment of Kazemnejad et al. 2023 ("The Impact of Positional Encoding on Length
Generalization in Transformers"), scaled down to a CPU: for the ``repeat`` and ``copy`` tasks and
each method (nope, learned, sinusoidal, rope, alibi, t5), train a small decoder on problem sizes
``1 .. L`` over several seeds, then measure exact match (greedy answer entirely right) at every
size ``1 .. 2L``. Their 107M-parameter models, trained on <= 20 and tested on 21-40 on the
repeat-copy task, scored NoPE 0.986, T5 bias 0.771, ALiBi 0.289, RoPE 0.0002, learned and
sinusoidal 0.000 (:data:`KAZEMNEJAD_2023`).

Results go into a run folder, each file written atomically:
``lengthgen.csv`` (tidy, one row per task, method, seed, length), ``summary.csv`` (mean exact
match on L+1 .. 2L per task and method, next to the published numbers), ``lengthgen.png`` and
``lengthgen.svg`` (accuracy against length, one line per method), and the stamp ``lengthgen.json``
(:func:`~nopelens.analyses.runs.claim`). A rerun with the same settings skips the (task, method,
seed) triples already in ``lengthgen.csv``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib.ticker
import pandas as pd
import seaborn as sns

from nopelens.models import DecoderConfig
from nopelens.models.io import write_csv_atomic
from nopelens.models.tasks import make_task
from nopelens.models.threads import limited_threads
from nopelens.models.training import evaluate_exact_match, train

from . import runs
from .figures import save_figure
from .palette import method_color

METHODS = ("nope", "learned", "sinusoidal", "rope", "alibi", "t5")
TASK_NAMES = ("repeat", "copy")

KAZEMNEJAD_2023 = {"nope": 0.986, "t5": 0.771, "alibi": 0.289, "rope": 0.0002, "learned": 0.000, "sinusoidal": 0.000}
"""Published exact match on the repeat-copy task, train <= 20 / test 21-40 (Kazemnejad et al. 2023)."""


@dataclass(frozen=True)
class LengthGenSettings:
    """Model and training settings shared by every (task, method, seed) run.

    Attributes:
        train_max_len: L; training sizes are ``1 .. L``, test sizes ``L+1 .. 2L``.
        n_layers, d_model, n_heads: decoder shape (d_mlp = 4 d_model).
        steps, batch_size, lr: training (AdamW, warmup then cosine; see ``train``).
        n_symbols: alphabet size of the tasks.
        n_eval: test sequences per length.
        threads: torch and BLAS threads while training and testing (the weights depend on it);
            in the run folder's stamp only when it is not 1, so older folders still resume.
    """

    train_max_len: int = 8
    n_layers: int = 3
    d_model: int = 64
    n_heads: int = 4
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    n_symbols: int = 16
    n_eval: int = 128
    threads: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"{f.name} must be positive, got {value!r}")

    def to_dict(self) -> dict:
        """The settings as the run folder's stamp holds them (``threads`` only when it is not 1)."""
        settings = dataclasses.asdict(self)
        if self.threads == 1:
            del settings["threads"]
        return settings

    @classmethod
    def quick(cls) -> "LengthGenSettings":
        """A smoke-test size (minutes on 2 cores); its numbers are not meant to be read."""
        return cls(train_max_len=5, n_layers=2, d_model=32, steps=60, batch_size=32, n_eval=32)


def _config(task, method: str, settings: LengthGenSettings) -> DecoderConfig:
    return DecoderConfig(
        d_vocab=task.d_vocab,
        n_ctx=task.seq_len(2 * settings.train_max_len),
        n_layers=settings.n_layers,
        d_model=settings.d_model,
        n_heads=settings.n_heads,
        position=method,
    )


def run_one(
    task_name: str, method: str, seed: int, settings: LengthGenSettings, progress: bool = False
) -> pd.DataFrame:
    """Train one model and return its exact match at every length ``1 .. 2L`` (tidy rows)."""
    task = make_task(task_name, n_symbols=settings.n_symbols)
    L = settings.train_max_len
    trained = train(
        _config(task, method, settings),
        task,
        settings.steps,
        batch_size=settings.batch_size,
        min_len=1,
        max_len=L,
        lr=settings.lr,
        seed=seed,
        progress=progress,
        threads=settings.threads,
    )
    with limited_threads(settings.threads):
        table = evaluate_exact_match(
            trained, task, range(1, 2 * L + 1), n=settings.n_eval, seed=10_000 + seed, progress=progress
        )
    table.insert(1, "method", method)
    table.insert(2, "seed", seed)
    table["train_max_len"] = L
    table["final_train_loss"] = trained.metadata["final_losses"]["train"]
    table["train_seconds"] = trained.metadata["train_seconds"]
    return table


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """Mean (and std over seeds) exact match on L+1 .. 2L and on 1 .. L, per task and method.

    The std is the sample std (ddof 1), so it is empty (NaN) for a task and method with one seed.

    Adds the published repeat-copy number of the method (Kazemnejad et al. 2023) for reference.
    """
    frame = results.assign(split=results["in_distribution"].map({True: "in_distribution", False: "longer"}))
    per_seed = frame.groupby(["task", "method", "seed", "split"], as_index=False)["exact_match"].mean()
    wide = per_seed.pivot_table(index=["task", "method", "seed"], columns="split", values="exact_match").reset_index()
    summary = wide.groupby(["task", "method"], as_index=False).agg(
        exact_match_longer=("longer", "mean"),
        exact_match_longer_std=("longer", "std"),
        exact_match_in_distribution=("in_distribution", "mean"),
        seeds=("seed", "nunique"),
    )
    summary["kazemnejad_2023_repeat_copy"] = summary["method"].map(KAZEMNEJAD_2023)
    order = {m: i for i, m in enumerate(METHODS)}
    return summary.sort_values(["task", "method"], key=lambda s: s.map(order) if s.name == "method" else s).reset_index(
        drop=True
    )


def plot(results: pd.DataFrame, out_stem: Path) -> list[Path]:
    """Draw :func:`lengthgen_figure` into ``<out_stem>.png`` and ``<out_stem>.svg``, atomically;
    returns their paths."""
    return save_figure(lengthgen_figure(results), out_stem)


def lengthgen_figure(results: pd.DataFrame):
    """Seaborn line plot of exact match against length, one line per method (in its fixed colour,
    :mod:`~nopelens.analyses.palette`), one panel per task: a point is a method's exact match at one
    problem size, the mean over seeds."""
    L = int(results["train_max_len"].iloc[0])
    methods = [m for m in METHODS if m in set(results["method"])]
    sns.set_theme(style="whitegrid", context="notebook")
    grid = sns.relplot(
        data=results,
        x="length",
        y="exact_match",
        hue="method",
        hue_order=methods,
        palette={m: method_color(m) for m in methods},
        col="task",
        kind="line",
        marker="o",
        errorbar=("pi", 100),
        height=3.3,
        aspect=1.3,
    )
    for ax in grid.axes.flat:
        ax.axvline(L + 0.5, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    grid.set_titles("{col_name}")
    grid.set_axis_labels("problem size (symbols)", "exact match (fraction of sequences)")
    grid.figure.suptitle(
        f"Length generalization: trained on sizes 1-{L} (left of the dashed line), tested up to "
        f"{2 * L}\n(a point: mean exact match over seeds; band: their range)",
        y=1.13,
    )
    return grid.figure


RESULT_COLUMNS = ("task", "method", "seed", "length", "exact_match", "in_distribution")
"""Columns a finished run's rows of ``lengthgen.csv`` must have."""


def _valid_rows(results: pd.DataFrame, train_max_len: int) -> pd.DataFrame:
    """The rows of ``lengthgen.csv`` that hold what a run writes, parsed: a known task and method, an
    integer seed >= 0 and length >= 1, an exact match in [0, 1], and ``in_distribution`` a boolean
    equal to ``length <= train_max_len``. pandas reads a column with one bad cell as text, so each
    is parsed here."""
    seed, length, exact = (
        pd.to_numeric(results[column], errors="coerce") for column in ("seed", "length", "exact_match")
    )
    flag = results["in_distribution"].map(
        lambda cell: {"true": True, "false": False, "1": True, "0": False}.get(str(cell).strip().lower())
    )

    def whole(number: pd.Series, low: int) -> pd.Series:
        return (number == number.round()) & number.between(low, 2**62)

    valid = (
        results["task"].isin(TASK_NAMES)
        & results["method"].isin(METHODS)
        & whole(seed, 0)
        & whole(length, 1)
        & exact.between(0, 1)
        & flag.notna()
        & (flag == (length <= train_max_len))
    )
    parsed = results.assign(seed=seed, length=length, exact_match=exact, in_distribution=flag)[valid]
    return parsed.astype({"seed": int, "length": int, "exact_match": float, "in_distribution": bool})


def _read_results(path: Path, train_max_len: int) -> pd.DataFrame:
    """The finished runs in ``lengthgen.csv``: none when it is missing; when it is emptied, cannot be
    read or lacks a column (a line says so) none either, and every run is measured again. A run with a
    damaged cell (empty, not a number, out of range: :func:`_valid_rows`), or whose rows do not cover
    every length ``1 .. 2 train_max_len`` (a truncated file), is left out, named, and measured again;
    the other runs are kept."""

    def measure_all_again(why: str) -> pd.DataFrame:
        print(f"nopelens lengthgen: {path} {why}; measuring every run again", file=sys.stderr)
        return pd.DataFrame()

    if not path.exists():
        return pd.DataFrame()
    try:
        results = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return measure_all_again("is empty")
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as error:
        return measure_all_again(f"cannot be read ({' '.join(str(error).split())[:200]})")
    missing = [column for column in RESULT_COLUMNS if column not in results]
    if missing:
        return measure_all_again(f"is damaged (columns {missing} missing)")
    run = ["task", "method", "seed"]
    # a row with a damaged cell is dropped; its run then lacks a length and is measured again below
    results = _valid_rows(results, train_max_len)
    lengths = set(range(1, 2 * train_max_len + 1))
    complete = results.groupby(run)["length"].transform(lambda rows: set(rows) == lengths and len(rows) == len(lengths))
    for (task, method, seed), _ in results[~complete.astype(bool)].groupby(run):
        print(
            f"nopelens lengthgen: {path} holds only part of {task} {method} seed {seed} (a truncated or damaged "
            "file?); measuring it again",
            file=sys.stderr,
        )
    return results[complete.astype(bool)].reset_index(drop=True)


def run_lengthgen(
    out_dir: str | Path,
    settings: LengthGenSettings | None = None,
    tasks: tuple[str, ...] = TASK_NAMES,
    methods: tuple[str, ...] = METHODS,
    seeds: tuple[int, ...] = (0, 1, 2),
    progress: bool = True,
) -> pd.DataFrame:
    """Run (or resume) the experiment into ``out_dir``; returns the tidy results.

    Raises:
        ValueError: on an unknown task or method, or if ``out_dir`` holds a run with other settings
            or another analysis's run.
    """
    settings = settings or LengthGenSettings()
    for kind, chosen, known in (("method", methods, METHODS), ("task", tasks, TASK_NAMES)):
        unknown = next((name for name in chosen if name not in known), None)
        if unknown is not None:
            raise ValueError(f"unknown {kind} {unknown!r}; choose from {known}")
    out_dir = runs.claim(out_dir, "lengthgen", settings.to_dict())
    csv_path = out_dir / "lengthgen.csv"
    results = _read_results(csv_path, settings.train_max_len)
    done = set() if results.empty else set(zip(results["task"], results["method"], results["seed"]))
    todo = [(t, m, s) for t in tasks for m in methods for s in seeds if (t, m, s) not in done]
    if progress and done:
        print(f"nopelens lengthgen: resuming; {len(done)} runs already in {csv_path}, {len(todo)} to go")
    for index, (task_name, method, seed) in enumerate(todo, start=1):
        clock = time.perf_counter()
        table = run_one(task_name, method, seed, settings, progress=progress)
        results = pd.concat([results, table], ignore_index=True) if len(results) else table
        write_csv_atomic(results, csv_path)
        if progress:
            longer = table.loc[~table["in_distribution"].astype(bool), "exact_match"].mean()
            inside = table.loc[table["in_distribution"].astype(bool), "exact_match"].mean()
            print(
                f"[{index}/{len(todo)}] {task_name:>6} {method:>10} seed {seed}: exact match "
                f"{inside:.3f} on 1-{settings.train_max_len}, {longer:.3f} on longer "
                f"({time.perf_counter() - clock:.0f} s)"
            )
    results["in_distribution"] = results["in_distribution"].astype(bool)
    summary = summarize(results)
    write_csv_atomic(summary, out_dir / "summary.csv")
    single = summary[summary["seeds"] < 2]
    if len(single):
        print(
            f"nopelens lengthgen: exact_match_longer_std is empty in summary.csv for {len(single)} task and method "
            "pair(s) with one seed (a std over seeds needs two)",
            file=sys.stderr,
        )
    plot(results, out_dir / "lengthgen")
    return results
