"""Length generalization: train on sizes 1..L, test exact match on L+1..2L, per position method,
side by side with Kazemnejad et al. 2023 ("The Impact of Positional Encoding on Length
Generalization in Transformers").

By default the paper's setting: its tasks (same-token copy ``repeat``, A->B copy ``replace``,
random-token copy ``copy`` and reverse ``reverse``; ``repeat_twice`` on request), train on sizes
1-20 and test on 21-40, its position-method choices (:data:`~nopelens.analyses.kazemnejad.VARIANTS`:
unscaled scores, one shared T5 table, RoPE on 25 % of each head in interleaved pairs) and the rows
of nopelens' own defaults where they differ. The training budget (``steps``) is fixed before the
comparison by :func:`~nopelens.analyses.lengthgen_pilot.run_pilot`'s in-distribution rule, never by
the out-of-distribution score.

Results go into a run folder, each file written atomically (the schema: docs/schema.md):
``lengthgen.csv`` (one row per task, method, seed, length), ``curve.csv`` (exact match on the
unseen sizes and validation loss at log-spaced steps through training), ``summary.csv`` (per task
and method: per-seed values, mean, 95 % CI, the released number), ``claims.csv`` (a verdict per
claim), ``attention_distance.csv`` (the paper's Sec. 5.2 Jensen-Shannon distance between every
pair of methods), ``summary.md``, figures (``lengthgen``, ``curve``, ``attention_distance``, PNG and
SVG), the trained models under ``models/`` and the stamp ``lengthgen.json``
(:func:`~nopelens.analyses.runs.claim`). A rerun with the same settings skips the (task, method,
seed) triples already in ``lengthgen.csv``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from nopelens.models import DecoderConfig
from nopelens.models.checkpoint import load_checkpoint, save_checkpoint
from nopelens.models.io import write_csv_atomic, write_text_atomic
from nopelens.models.tasks import make_task
from nopelens.models.threads import limited_threads
from nopelens.models.training import evaluate_exact_match, train, validation_loss

from . import kazemnejad, runs
from .attention_distance import pairwise_table
from .kazemnejad import SECOND_SEED
from .lengthgen_figures import plot, plot_curve, plot_distances
from .lengthgen_folder import read_curve, read_results, runs_in
from .sweep.parallel import run_tasks

METHODS = tuple(kazemnejad.VARIANTS)
"""Every row name (:data:`~nopelens.analyses.kazemnejad.VARIANTS`)."""
DEFAULT_METHODS = kazemnejad.PAPER_VARIANTS + kazemnejad.DEFAULT_ROWS
TASK_NAMES = tuple(kazemnejad.PAPER_TASKS)
DEFAULT_TASKS = ("repeat", "replace", "copy", "reverse")
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class LengthGenSettings:
    """Model and training settings shared by every (task, method, seed) run.

    Attributes:
        train_max_len: L; training sizes are ``1 .. L``, test sizes ``L+1 .. 2L`` (the paper: 20).
        n_layers, d_model, n_heads: decoder shape (d_mlp = 4 d_model). 3 layers of d_model 64
            (about 0.03 s a step on one thread): 2 layers of d_model 32 left the random-token copy
            and reverse unlearned in distribution; at this size the pilot learned every default
            task in distribution (exact match on sizes 1-20 at least 0.99) but NoPE's reverse (0.76).
        steps, batch_size, lr: training (AdamW, warmup then cosine; see ``train``). ``steps`` is
            fixed by :func:`~nopelens.analyses.lengthgen_pilot.run_pilot`'s in-distribution rule
            (``nopelens lengthgen --pilot --steps 3000``; docs/results.md records the pilot).
        n_symbols: alphabet size of the tasks (the paper's random-token tasks draw from 100).
        n_eval: test sequences per length at the end of training.
        curve_points: log-spaced steps (halving back from ``steps``) where the exact match on the
            unseen sizes is recorded through training, the last one included.
        threads: torch and BLAS threads while training and testing (the weights depend on it);
            in the run folder's stamp only when it is not 1.
    """

    train_max_len: int = 20
    n_layers: int = 3
    d_model: int = 64
    n_heads: int = 4
    steps: int = 2700
    batch_size: int = 32
    lr: float = 3e-3
    n_symbols: int = 100
    n_eval: int = 32
    curve_points: int = 6
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
        """A smoke-test size (seconds); its numbers are not meant to be read."""
        return cls(
            train_max_len=4,
            n_layers=2,
            d_model=16,
            n_heads=2,
            steps=24,
            batch_size=8,
            n_symbols=6,
            n_eval=8,
            curve_points=2,
        )

    def curve_steps(self) -> list[int]:
        """The log-spaced steps of the training curve: ``steps / 2^k`` for k < ``curve_points``."""
        return sorted({max(1, round(self.steps / 2**k)) for k in range(self.curve_points)})


def _config(task, method: str, settings: LengthGenSettings) -> DecoderConfig:
    variant = kazemnejad.VARIANTS[method]
    return DecoderConfig(
        d_vocab=task.d_vocab,
        n_ctx=task.seq_len(2 * settings.train_max_len),
        n_layers=settings.n_layers,
        d_model=settings.d_model,
        n_heads=settings.n_heads,
        position=variant.position,
        **variant.options,
    )


def _task(task_name: str, settings: LengthGenSettings):
    return make_task(task_name, n_symbols=settings.n_symbols)


def run_one(
    task_name: str,
    method: str,
    seed: int,
    settings: LengthGenSettings,
    progress: bool = False,
    model_dir: Path | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train one model; return its exact match at every size ``1 .. 2L`` and its training curve.

    The curve holds, at each of ``settings.curve_steps()``, the exact match on the unseen sizes
    (``n_eval // 4`` sequences per size, at least 4; the last step uses the final ``n_eval``) and the
    validation loss on held-out training sizes. Evaluating during training leaves the batches and
    the weights unchanged. With ``model_dir`` the final model is saved there (safetensors + JSON).
    """
    task = _task(task_name, settings)
    L = settings.train_max_len
    longer = range(L + 1, 2 * L + 1)
    curve = []

    def record(step: int, loss: float, model) -> None:
        if step in settings.curve_steps() and step < settings.steps:
            table = evaluate_exact_match(model, task, longer, n=max(4, settings.n_eval // 4), seed=20_000 + seed)
            curve.append(
                dict(
                    step=step,
                    exact_match_longer=float(table["exact_match"].mean()),
                    validation_loss=validation_loss(model, task, 1, L, seed=seed, n=128),
                )
            )

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
        callback=record,
        desc=f"train {task_name} {method} seed {seed}",  # the row's name: t5_shared and t5_per_layer are both t5
    )
    clock = time.perf_counter()
    with limited_threads(settings.threads):
        table = evaluate_exact_match(
            trained, task, range(1, 2 * L + 1), n=settings.n_eval, seed=10_000 + seed, progress=progress
        )
    curve.append(
        dict(
            step=settings.steps,
            exact_match_longer=float(table.loc[~table["in_distribution"], "exact_match"].mean()),
            validation_loss=trained.metadata["final_losses"]["validation"],
        )
    )
    if model_dir is not None:
        save_checkpoint(model_dir, trained)
    ids = dict(task=task_name, method=method, seed=seed)
    table = table.drop(columns="task").assign(**ids)[["task", "method", "seed", *table.columns.drop("task")]]
    table["train_max_len"] = L
    table["final_train_loss"] = trained.metadata["final_losses"]["train"]
    table["train_seconds"] = trained.metadata["train_seconds"]
    table["eval_seconds"] = time.perf_counter() - clock
    return table, pd.DataFrame(curve).assign(**ids)[
        ["task", "method", "seed", "step", "exact_match_longer", "validation_loss"]
    ]


def summarize(results: pd.DataFrame, n_symbols: int = LengthGenSettings.n_symbols) -> pd.DataFrame:
    """Per task and method: the side-by-side row (:func:`~nopelens.analyses.kazemnejad.side_by_side`)."""
    return kazemnejad.side_by_side(results, n_symbols)


def _model_dir(out_dir: Path, task: str, method: str, seed: int) -> Path:
    return out_dir / "models" / task / method / f"seed{seed}"


def _covering(tasks, methods, seeds, runs: set) -> tuple[tuple, tuple, tuple]:
    """The tasks and methods asked for, then those of the folder's finished ``runs`` not asked for,
    and every seed of either in order: the summary and the distances cover every run in the folder,
    however narrow the rerun."""
    return (
        (*tasks, *sorted({t for t, _, _ in runs} - set(tasks), key=TASK_NAMES.index)),
        (*methods, *sorted({m for _, m, _ in runs} - set(methods), key=METHODS.index)),
        tuple(sorted(set(seeds) | {s for _, _, s in runs})),
    )


def _distance_models(task_name: str, methods, seeds, runs: set) -> dict[str, tuple[str, int]]:
    """The models the Sec. 5.2 distances read for ``task_name``: each method's first seed, and
    NoPE's second seed (:data:`SECOND_SEED`) when there is one, among ``runs`` (finished or to be
    trained); name -> (method, seed)."""
    wanted = {m: (m, seeds[0]) for m in methods}
    if kazemnejad.PAPER_VARIANTS[0] in methods and len(seeds) > 1:
        wanted[SECOND_SEED] = (kazemnejad.PAPER_VARIANTS[0], seeds[1])
    return {name: run for name, run in wanted.items() if (task_name, *run) in runs}


def _unreadable_models(out_dir: Path, tasks, methods, seeds, done: set) -> set:
    """The finished runs whose saved model the distances need but cannot load (deleted, damaged),
    named in one line on stderr: they are trained again, so the distance table never loses a row."""
    unreadable = {}
    for task_name in tasks:
        for method, seed in _distance_models(task_name, methods, seeds, done).values():
            path = _model_dir(out_dir, task_name, method, seed)
            try:
                load_checkpoint(path)
            except (ValueError, OSError) as error:
                unreadable[task_name, method, seed] = (path, "missing" if not path.exists() else str(error))
    if unreadable:
        path, reason = next(iter(unreadable.values()))
        print(
            f"nopelens lengthgen: {len(unreadable)} saved model(s) the attention distances read cannot be "
            f"loaded (first: {path}: {' '.join(reason.split())[:120]}); training them again",
            file=sys.stderr,
        )
    return set(unreadable)


def measure_distances(
    out_dir: Path, settings: LengthGenSettings, tasks, methods, seeds, runs: set, n: int = 32
) -> pd.DataFrame:
    """The Sec. 5.2 distances per task between the models of :func:`_distance_models` among
    ``runs``, all reading the same ``n`` sequences of size L, from the models saved in ``out_dir``'s
    ``models/``.

    Raises:
        ValueError: if a saved model cannot be loaded (:func:`run_lengthgen` trains such a model
            again before it gets here).
    """
    rows = []
    for task_name in tasks:
        models = {
            name: load_checkpoint(_model_dir(out_dir, task_name, method, seed)).model.eval()
            for name, (method, seed) in _distance_models(task_name, methods, seeds, runs).items()
        }
        if len(models) < 2:
            continue
        task = _task(task_name, settings)
        tokens = task.sample(n, settings.train_max_len, settings.train_max_len, seed=30_000).tokens
        with limited_threads(settings.threads):
            rows += [dict(task=task_name, **row) for row in pairwise_table(models, tokens)]
    return pd.DataFrame(rows, columns=["task", "model_a", "model_b", "layer", "jsd_bits", "head_a", "head_b"])


def _fmt(value: float) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def summary_markdown(
    settings: LengthGenSettings,
    summary: pd.DataFrame,
    claims: pd.DataFrame,
    distances: pd.DataFrame,
    distance_claims: pd.DataFrame,
    seconds: float,
    train_seconds: pd.Series | None = None,
) -> str:
    """The run's ``summary.md``: settings, the side-by-side table, the verdicts and the distances."""
    L = settings.train_max_len
    side = pd.DataFrame(
        {
            "task (paper)": summary["task"] + " (" + summary["paper_task"] + ")",
            "method": summary["method"],
            f"exact match {L + 1}-{2 * L}, mean [95 % CI]": [
                f"{_fmt(m)} [{_fmt(lo)}, {_fmt(hi)}]"
                for m, lo, hi in zip(summary["exact_match_longer"], summary["ci_low"], summary["ci_high"])
            ],
            "per seed": summary["per_seed"],
            "released": [_fmt(v) for v in summary["released"]],
            "released per seed": summary["released_per_seed"],
            f"exact match 1-{L}": [_fmt(v) for v in summary["exact_match_in_distribution"]],
            f"token accuracy {L + 1}-{2 * L} (floor {1 / settings.n_symbols:.3f})": [
                _fmt(v) for v in summary["token_accuracy_longer"]
            ],
        }
    )
    parts = [
        "# Kazemnejad et al. 2023 side by side (`nopelens lengthgen`)",
        "",
        *(
            [
                "**Quick mode (`--quick`): a smoke test at toy size; its numbers and verdicts "
                "are not meant to be read.**",
                "",
            ]
            if settings == LengthGenSettings.quick()
            else []
        ),
        f"Settings: {settings.to_dict()}; training sizes 1-{L}, test sizes {L + 1}-{2 * L}. "
        f"Time: {seconds / 60:.1f} min wall in this session"
        + (
            ""
            if train_seconds is None
            else f"; {len(train_seconds)} models in the folder, {train_seconds.sum() / 60:.1f} min "
            f"of training in all (median {train_seconds.median():.0f} s per model)"
        )
        + ".",
        "",
        "Rows: "
        + "; ".join(f"`{name}`: {v.note}" for name, v in kazemnejad.VARIANTS.items() if name in set(summary["method"])),
        "",
        f"Released numbers: {kazemnejad.RELEASED_SOURCE}. Exact match is the paper's metric (every answer token "
        "right); its no-information floor is 0 (a uniform guess is right with probability n_symbols^-size).",
        "",
        side.to_markdown(index=False),
        "",
        "## Verdicts: NoPE against each explicit method (paper's choices)",
        "",
        f"A claim exists where the released means differ by more than {kazemnejad.TIE}; our difference is NoPE "
        "minus the method, mean over seeds, with a 95 % Welch CI.",
        "",
    ]
    if len(claims):
        shown = claims.assign(
            **{c: claims[c].map(_fmt) for c in ("released_difference", "difference", "ci_low", "ci_high")}
        )
        parts.append(shown.drop(columns="paper_task").to_markdown(index=False))
    if len(distances):
        mean = (
            distances[distances["model_a"] != distances["model_b"]]
            .groupby(["task", "model_a", "model_b"], as_index=False)["jsd_bits"]
            .mean()
        )
        from_nope = mean[mean["model_a"] == kazemnejad.PAPER_VARIANTS[0]].pivot_table(
            index="task", columns="model_b", values="jsd_bits"
        )
        parts += [
            "",
            "## Attention distance from NoPE (Sec. 5.2)",
            "",
            "Mean over query positions of the Jensen-Shannon divergence (bits) of two heads' attention rows, "
            "minimum over head pairs, mean over layers; every model reads the same sequences of size "
            f"{L}. Full table: attention_distance.csv.",
            "",
            from_nope.map(_fmt).reset_index().to_markdown(index=False),
            "",
        ]
        if len(distance_claims):
            parts.append(distance_claims.to_markdown(index=False))
    parts += [
        "",
        "Figures: lengthgen.png (exact match by size), curve.png (out-of-distribution exact match through "
        "training), attention_distance.png.",
        "",
    ]
    return "\n".join(parts)


def _run_and_save(task_name: str, method: str, seed: int, settings, progress: bool, model_dir: Path) -> tuple:
    """:func:`run_one` as a worker process's task: its tables and wall seconds."""
    clock = time.perf_counter()
    table, curve = run_one(task_name, method, seed, settings, progress=progress, model_dir=model_dir)
    return table, curve, time.perf_counter() - clock


def run_lengthgen(
    out_dir: str | Path,
    settings: LengthGenSettings | None = None,
    tasks: tuple[str, ...] = DEFAULT_TASKS,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    seeds: tuple[int, ...] = DEFAULT_SEEDS,
    progress: bool = True,
    default_row_seeds: tuple[int, ...] | None = None,
    figures: bool = True,
    jobs: int = 1,
) -> pd.DataFrame:
    """Run (or resume) the side-by-side into ``out_dir``; returns the tidy per-length results.

    Args:
        out_dir: the run folder.
        settings: model and training settings (default :class:`LengthGenSettings`).
        tasks: task names (:data:`TASK_NAMES`).
        methods: row names (:data:`METHODS`).
        seeds: training seeds of every row.
        progress: progress bars and one line per trained model.
        default_row_seeds: seeds of the rows of nopelens' defaults
            (:data:`~nopelens.analyses.kazemnejad.DEFAULT_ROWS`) when they should use fewer.
        figures: draw the figures (the tables and ``summary.md`` are always written).
        jobs: models trained at once, each in its own worker process on ``settings.threads``
            threads (:func:`~nopelens.analyses.sweep.parallel.run_tasks`); the weights and numbers
            do not depend on it. 1: in this process.

    Raises:
        ValueError: on an unknown task or method, one listed twice, no seeds, ``default_row_seeds``
            not among ``seeds``, ``jobs`` < 1, or if ``out_dir`` holds a run with other settings or
            another analysis's run, or another run is using it (:func:`~nopelens.analyses.runs.claimed`).
    """
    settings = settings or LengthGenSettings()
    for kind, chosen, known in (("method", methods, METHODS), ("task", tasks, TASK_NAMES)):
        unknown = next((name for name in chosen if name not in known), None)
        if unknown is not None:
            raise ValueError(f"unknown {kind} {unknown!r}; choose from {known}")
        twice = next((name for name in chosen if chosen.count(name) > 1), None)
        if twice is not None:  # each would be trained and written twice
            raise ValueError(f"the {kind} {twice!r} is listed twice")
    if not seeds:
        raise ValueError("give at least one seed")
    if default_row_seeds is not None and not set(default_row_seeds) <= set(seeds):
        raise ValueError(
            f"--default-row-seeds {','.join(map(str, default_row_seeds))} must be among --seeds "
            f"{','.join(map(str, seeds))} (it gives the default rows fewer of them)"
        )
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    with runs.claimed(out_dir, "lengthgen", settings.to_dict()) as out_dir:
        return _run(out_dir, settings, tasks, methods, seeds, progress, default_row_seeds, figures, jobs)


def _run(out_dir: Path, settings, tasks, methods, seeds, progress, default_row_seeds, figures, jobs) -> pd.DataFrame:
    """:func:`run_lengthgen` in its claimed and held folder."""
    csv_path, curve_path = out_dir / "lengthgen.csv", out_dir / "curve.csv"
    results = read_results(csv_path, settings.train_max_len)
    done = set() if results.empty else set(zip(results["task"], results["method"], results["seed"]))
    curve, damaged = read_curve(curve_path, done, settings.curve_steps())
    redo = damaged | _unreadable_models(out_dir, *_covering(tasks, methods, seeds, done), done)
    if redo:  # measured again: their rows go, so that none is written twice
        done -= redo
        results, curve = runs_in(results, done), runs_in(curve, done)
    row_seeds = {m: (default_row_seeds or seeds) if m in kazemnejad.DEFAULT_ROWS else seeds for m in methods}
    # the paper's rows first, seed by seed: a run cut short has every task and method at fewer seeds
    todo = sorted(
        ((t, m, s) for t in tasks for m in methods for s in row_seeds[m] if (t, m, s) not in done),
        key=lambda run: (run[1] in kazemnejad.DEFAULT_ROWS, run[2], tasks.index(run[0]), methods.index(run[1])),
    )
    if progress and done:
        print(f"nopelens lengthgen: resuming; {len(done)} runs already in {csv_path}, {len(todo)} to go")
    clock_all = time.perf_counter()
    finished = 0

    def on_done(key: tuple, result: tuple) -> None:
        nonlocal results, curve, finished
        (task_name, method, seed), (table, run_curve, seconds) = key, result
        curve = pd.concat([curve, run_curve], ignore_index=True) if len(curve) else run_curve
        write_csv_atomic(curve, curve_path)
        results = pd.concat([results, table], ignore_index=True) if len(results) else table
        write_csv_atomic(results, csv_path)
        finished += 1
        if progress:
            longer = table.loc[~table["in_distribution"].astype(bool), "exact_match"].mean()
            inside = table.loc[table["in_distribution"].astype(bool), "exact_match"].mean()
            print(
                f"[{finished}/{len(todo)}] {task_name:>12} {method:>12} seed {seed}: exact match {inside:.3f} on "
                f"1-{settings.train_max_len}, {longer:.3f} on longer ({seconds:.0f} s)",
                flush=True,
            )

    bars = progress and jobs == 1  # worker processes would interleave their bars
    run_tasks(
        _run_and_save,
        [((t, m, s), (t, m, s, settings, bars, _model_dir(out_dir, t, m, s))) for t, m, s in todo],
        on_done,
        jobs=jobs,
    )
    results["in_distribution"] = results["in_distribution"].astype(bool)
    asked = {(t, m, s) for t in tasks for m in methods for s in row_seeds[m]}
    held = set(zip(results["task"], results["method"], results["seed"]))
    beyond = sorted(held - asked)
    if beyond:
        print(
            f"nopelens lengthgen: {out_dir} also holds {len(beyond)} run(s) not asked for this time "
            f"({' '.join(map(str, beyond[0]))}{', ...' if len(beyond) > 1 else ''}); "
            "the summary and the distances cover every run there",
            file=sys.stderr,
        )
    summary = summarize(results, settings.n_symbols)
    claims = kazemnejad.ranking_verdicts(results)
    distances = measure_distances(out_dir, settings, *_covering(tasks, methods, seeds, held), held)
    nope_rows = summary[summary["method"] == kazemnejad.PAPER_VARIANTS[0]]
    unlearned = frozenset(nope_rows.loc[nope_rows["exact_match_in_distribution"] < kazemnejad.LEARNED, "task"])
    distance_claims = kazemnejad.distance_verdicts(distances, second=SECOND_SEED, unlearned=unlearned)
    for name, table in (
        ("summary", summary),
        ("claims", claims),
        ("attention_distance", distances),
        ("distance_claims", distance_claims),
    ):
        write_csv_atomic(table, out_dir / f"{name}.csv")
    per_model = (
        results.groupby(["task", "method", "seed"])["train_seconds"].first() if "train_seconds" in results else None
    )
    write_text_atomic(
        out_dir / "summary.md",
        summary_markdown(
            settings, summary, claims, distances, distance_claims, time.perf_counter() - clock_all, per_model
        ),
    )
    if figures:
        plot(results, out_dir / "lengthgen")
        plot_curve(curve, out_dir / "curve")
        if len(distances):
            plot_distances(distances, out_dir / "attention_distance")
        plt.close("all")
    return results
