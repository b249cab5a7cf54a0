"""The in-distribution pilot that fixes ``nopelens lengthgen``'s training budget before the
comparison runs (:mod:`~nopelens.analyses.lengthgen`): the validation loss on the training sizes,
and the step by which it levelled off. Nothing out of distribution is measured."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from nopelens.models.io import write_csv_atomic
from nopelens.models.training import evaluate_exact_match, train, validation_loss

from . import runs
from .figures import save_figure
from .lengthgen import DEFAULT_TASKS, LengthGenSettings, _config, _task

PILOT_METHODS = ("nope", "rope")
PILOT_SEED = 1000  # a seed the comparison never uses


def levelled_step(curve: pd.DataFrame, share: float = 0.99, last_quarter: float = 0.05) -> int | None:
    """The in-distribution budget rule, on one pilot curve of validation loss against step.

    The curve has levelled off when the last quarter of the pilot's steps brought less than
    ``last_quarter`` of its whole drop (first logged value to lowest); then the budget is the first
    logged step by which the loss made ``share`` of that drop. None when it has not levelled off.

    >>> levelled_step(pd.DataFrame({"step": [100, 200, 300, 400], "validation_loss": [2.0, 0.5, 0.2, 0.19]}))
    300
    >>> levelled_step(pd.DataFrame({"step": [100, 200, 300, 400], "validation_loss": [4.0, 3.8, 3.5, 3.2]})) is None
    True
    """
    curve = curve.sort_values("step")
    steps, losses = curve["step"].to_numpy(), curve["validation_loss"].to_numpy()
    drop = losses[0] - losses.min()
    late = losses[steps <= 0.75 * steps[-1]][-1] - losses[-1]
    if drop <= 0:
        return int(steps[0])
    if late >= last_quarter * drop:
        return None
    return int(steps[np.argmax(losses <= losses.min() + (1 - share) * drop)])


def check_pilot_folder(out_dir: Path, settings: LengthGenSettings) -> None:
    """Refuse a pilot's ``out_dir`` when writing there would lose or mislabel a record: a pilot
    writes into a new or empty folder, or beside the ``nopelens lengthgen`` comparison whose budget
    it fixed (as docs/lengthgen/ does): not where a ``pilot.csv`` is already (the record that fixed
    a budget), nor beside a comparison whose settings differ from the pilot's in more than
    ``steps``, nor into a folder of anything else.

    Raises:
        ValueError: naming what is there and what to do.
    """
    runs.refuse_other_runs(out_dir, "lengthgen --pilot", "lengthgen")
    if (out_dir / "pilot.csv").exists():
        raise ValueError(
            f"{out_dir} holds a pilot already (pilot.csv, the record that fixed a budget); "
            "use another --out folder for this pilot"
        )
    comparison = runs.stamped_settings(out_dir, "lengthgen") if out_dir.is_dir() else None
    if comparison is None and out_dir.is_dir() and any(out_dir.iterdir()):
        raise ValueError(
            f"{out_dir} holds files of its own; a pilot writes into a new or empty folder, or beside the "
            "lengthgen comparison whose budget it fixes: use another --out folder"
        )
    differ = runs.setting_changes(comparison, settings.to_dict(), ignore=("steps",)) if comparison is not None else []
    if differ:
        raise ValueError(
            f"{out_dir} holds a lengthgen comparison with other settings ({'; '.join(differ)}); "
            "use another --out folder for this pilot"
        )


def run_pilot(
    out_dir: str | Path,
    settings: LengthGenSettings,
    tasks=DEFAULT_TASKS,
    methods=PILOT_METHODS,
    seed: int = PILOT_SEED,
    points: int = 20,
    progress: bool = True,
) -> pd.DataFrame:
    """Fix the training budget in advance by an in-distribution criterion.

    Trains each (task, method) once for ``settings.steps`` on a seed the comparison never uses,
    logging the validation loss on held-out training sizes (1..L) and the exact match there (8
    sequences per size) at ``points`` evenly spaced steps. Writes ``pilot.csv`` (``task``,
    ``method``, ``step``, ``validation_loss``, ``exact_match_in_distribution``, ``levelled_step``) and
    ``pilot.png``/``.svg`` into ``out_dir``; :func:`chosen_budget` reads the budget from it. Nothing out
    of distribution is measured.

    Raises:
        ValueError: before anything is trained, if ``out_dir`` (:func:`check_pilot_folder`) holds a
            pilot already, another analysis's run, or a comparison made with other settings.
    """
    out_dir = Path(out_dir)
    check_pilot_folder(out_dir, settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    every = max(1, settings.steps // points)
    frames = []
    for task_name in tasks:
        task = _task(task_name, settings)
        for method in methods:
            rows = []

            def record(step: int, loss: float, model, rows=rows, task=task) -> None:
                if step % every == 0:
                    sizes = range(1, settings.train_max_len + 1)
                    rows.append(
                        dict(
                            step=step,
                            validation_loss=validation_loss(model, task, 1, settings.train_max_len, seed=seed, n=128),
                            exact_match_in_distribution=float(
                                evaluate_exact_match(model, task, sizes, n=8, seed=seed + 1)["exact_match"].mean()
                            ),
                        )
                    )

            train(
                _config(task, method, settings),
                task,
                settings.steps,
                batch_size=settings.batch_size,
                min_len=1,
                max_len=settings.train_max_len,
                lr=settings.lr,
                seed=seed,
                progress=progress,
                threads=settings.threads,
                callback=record,
            )
            curve = pd.DataFrame(rows).assign(task=task_name, method=method)
            frames.append(curve.assign(levelled_step=levelled_step(curve)))  # NaN: not levelled off
            if progress:
                print(
                    f"pilot {task_name} {method}: validation loss {curve['validation_loss'].iloc[0]:.3f} -> "
                    f"{curve['validation_loss'].iloc[-1]:.3f}; levelled by step {frames[-1]['levelled_step'].iloc[0]}; "
                    f"exact match on sizes 1-L at the end {curve['exact_match_in_distribution'].iloc[-1]:.2f}"
                )
    columns = ["task", "method", "step", "validation_loss", "exact_match_in_distribution", "levelled_step"]
    pilot = pd.concat(frames, ignore_index=True)[columns]
    write_csv_atomic(pilot, out_dir / "pilot.csv")
    sns.set_theme(style="whitegrid", context="notebook")
    grid = sns.relplot(
        data=pilot,
        x="step",
        y="validation_loss",
        hue="method",
        col="task",
        kind="line",
        marker="o",
        height=3.0,
        aspect=1.2,
        facet_kws={"sharey": False},
    )
    grid.set_axis_labels("training step", "validation loss (nats/token), sizes 1-L")
    save_figure(grid.figure, out_dir / "pilot")
    return pilot


def chosen_budget(pilot: pd.DataFrame) -> int | None:
    """The steps the comparison trains for: the largest levelled step among the pilot curves that
    levelled off, rounded up to the pilot's logging grid; None when none did. Curves that did not
    level off within the pilot (``levelled_step`` empty) need more than it ran: say so next to the result."""
    levelled = pilot["levelled_step"].dropna()
    if levelled.empty:
        return None
    every = int(pilot["step"].min())
    return int(math.ceil(levelled.max() / every) * every)
