"""The Haviv comparison zoo's training, as ``nopelens compare haviv`` reports it
(:mod:`~nopelens.analyses.haviv`): the levelling-off rule fixed before training (docs/zoo.md), each
model's training curve, and the validation losses next to the paper's Table 1 perplexities."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from nopelens.models import zoo
from nopelens.models.checkpoint import load_checkpoint
from nopelens.models.tasks import TextTask
from nopelens.models.training import validation_loss

from . import haviv_paper as paper

LEVELLED_TOLERANCE = 0.01
"""The comparison zoo's in-distribution rule, fixed before training (docs/zoo.md): levelled off when
the mean training loss over the last tenth of the steps is within 1 % of the tenth before."""

OVERFIT_TOLERANCE = 0.05
"""The same rule's second half: the final validation loss at most 5 % above the last tenth's
training loss."""


def training_levelled(curve: pd.DataFrame | None, validation: float) -> dict:
    """The levelling-off rule on a training run: ``train_loss_last`` and ``train_loss_before`` (mean
    loss over the last tenth of the steps and the tenth before, nats), ``levelled_off``,
    ``validation_over_train`` (final validation / train_loss_last - 1) and ``trained_enough``
    (levelled off, and validation within :data:`OVERFIT_TOLERANCE` of training). NaN and False
    without a loss curve of at least 20 steps.

    Example:
        >>> out = training_levelled(pd.DataFrame({"loss": [3.0] * 80 + [2.0] * 10 + [1.99] * 10}), 2.0)
        >>> out["levelled_off"], round(out["validation_over_train"], 4), out["trained_enough"]
        (True, 0.005, True)
    """
    if curve is None or "loss" not in curve or len(curve) < 20:
        return dict(
            train_loss_last=math.nan,
            train_loss_before=math.nan,
            levelled_off=False,
            validation_over_train=math.nan,
            trained_enough=False,
        )
    tenth = len(curve) // 10
    last, before = curve["loss"].iloc[-tenth:].mean(), curve["loss"].iloc[-2 * tenth : -tenth].mean()
    levelled = bool(last >= before * (1 - LEVELLED_TOLERANCE))
    over = validation / last - 1
    return dict(
        train_loss_last=float(last),
        train_loss_before=float(before),
        levelled_off=levelled,
        validation_over_train=float(over),
        trained_enough=levelled and bool(over <= OVERFIT_TOLERANCE),
    )


def _loss_curve(spec: str, train_seed: int = 0) -> pd.DataFrame | None:
    """The training loss curve of a zoo model at ``train_seed`` (its cached or shipped run) or a
    checkpoint directory, as its checkpoint records it (checked against the checksum written with
    it); None without one.

    Raises:
        ValueError: naming the checkpoint, when its curve is damaged or not numbers.
    """
    if spec not in zoo.RECIPES:
        folder = spec
    elif zoo.is_cached(spec, seed=train_seed):
        folder = zoo.model_dir(spec, seed=train_seed)
    else:
        folder = zoo.shipped_dir(spec, seed=train_seed)
    curve = load_checkpoint(folder).loss_curve
    if curve.empty or "loss" not in curve:
        return None
    if not pd.api.types.is_numeric_dtype(curve["loss"]) or not np.isfinite(curve["loss"]).all():
        raise ValueError(f"the loss curve of {spec} holds values that are not finite numbers")
    return curve


CURVE_POINTS = 300
"""Points of each model's smoothed training curve in ``training.csv``."""


def training_curves(metas: list[dict]) -> pd.DataFrame:
    """Each model's training loss through its run (its ``loss_curve.csv``), in bits per byte, as the
    mean over the last ``steps / 60`` steps (a trailing window; 100 steps at 6000), at about
    :data:`CURVE_POINTS` steps at most (and the last); with the two tenths the levelling-off rule
    (:func:`training_levelled`) compares marked by ``tenth`` (``last``, ``before``, else empty).

    Returns:
        columns ``model``, ``train_seed``, ``method``, ``step``, ``train_bits_per_byte``,
        ``window``, ``tenth``; no rows for a model without a loss curve.
    """
    frames = []
    for meta in metas:
        curve = _loss_curve(meta["model"], meta["train_seed"])
        if curve is None or "loss" not in curve or len(curve) < 20:
            continue
        n = len(curve)
        window, every = max(1, n // 60), -(-n // CURVE_POINTS)
        smooth = curve["loss"].rolling(window, min_periods=1).mean() / math.log(2)
        index = np.arange(n)
        keep = (index % every == every - 1) | (index == n - 1)
        tenth = np.where(index >= n - n // 10, "last", np.where(index >= n - 2 * (n // 10), "before", ""))
        frames.append(
            pd.DataFrame(
                dict(
                    model=meta["model"],
                    train_seed=meta["train_seed"],
                    method=meta["method"],
                    step=curve["step"].to_numpy()[keep],
                    train_bits_per_byte=smooth.to_numpy()[keep],
                    window=window,
                    tenth=tenth[keep],
                )
            )
        )
    columns = ["model", "train_seed", "method", "step", "train_bits_per_byte", "window", "tenth"]
    return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)


def unseen_loss(model, task, window: int) -> tuple[float, int]:
    """A text model's loss on the validation documents that share no 64-byte string with its
    training text (``split="unseen"`` of :meth:`~nopelens.models.tasks.TextTask.windows`), in
    windows of ``window`` bytes (one shorter window when there are fewer unseen bytes than that):
    (bits per byte, bytes scored); (NaN, 0) when no document is unseen (its table cell says so).

    Raises:
        ValueError: if ``task`` is not a text task.
    """
    if not isinstance(task, TextTask):
        raise ValueError(f"the unseen loss reads text; the {task.name} task has none")
    try:
        available = len(task.stream("unseen"))
    except ValueError:  # no validation document is unseen
        return math.nan, 0
    length = min(window, available)
    scored = available // length * length  # the whole windows validation_loss scores
    return validation_loss(model, task, 1, length, split="unseen") / math.log(2), scored


def losses(metas: list[dict]) -> pd.DataFrame:
    """Validation bits per byte by model and training seed (every validation byte, and the unseen
    documents alone), whether its training levelled off (:func:`training_levelled`), the gaps to
    the learned-position model when there is one (its mean over seeds), and the paper's Table 1
    perplexities (and their gap to learned) for the same method."""
    rows = pd.DataFrame(
        [
            dict(
                model=m["model"],
                train_seed=m["train_seed"],
                method=m["method"],
                reads_positions=m["reads_positions"],
                bits_per_byte=m["bits_per_byte"],
                unseen_bits_per_byte=m["unseen_bits_per_byte"],
                unseen_bytes=m["unseen_bytes"],
                corpus=m["corpus"],
                **training_levelled(_loss_curve(m["model"], m["train_seed"]), m["bits_per_byte"] * math.log(2)),
            )
            for m in metas
        ]
    )
    for column in ("bits_per_byte", "unseen_bits_per_byte"):
        learned = rows.loc[rows["method"] == paper.BASELINE, column]
        gap = column.replace("bits_per_byte", "gap_to_learned")
        rows[gap] = rows[column] / learned.mean() - 1 if len(learned) else np.nan
    for dataset in ("wikitext-103", "the_pile"):
        ppl = [paper.PAPER_PERPLEXITY.get((dataset, m), np.nan) for m in rows["method"]]
        rows[f"paper_ppl_{dataset}"] = ppl
        rows[f"paper_gap_{dataset}"] = [
            np.log2(p) / np.log2(paper.PAPER_PERPLEXITY[(dataset, paper.BASELINE)]) - 1 for p in ppl
        ]
    rows["paper_source"] = paper.PERPLEXITY_FILE
    return rows
