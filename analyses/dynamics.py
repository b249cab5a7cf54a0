"""``nopelens dynamics MODEL``: position and attention sinks followed through training.

A zoo model is trained again from its recipe (same seed, so the last checkpoint is the zoo
model itself, bit for bit on the same CPU and torch), and a checkpoint is kept at log-spaced
steps (step 0 is the initialization). Each checkpoint is measured with the sweep's own probes on
the same evaluation sequences:

- absolute-index R^2 at every residual layer (ridge regression, grouped CV, 95 % bootstrap CI);
- the head-score read of i - j of every block (``hook_attn_scores``, reported at layer l + 1);
- Gu et al.'s sink rate with a 95 % CI over sequences (:func:`~nopelens.probes.sinks.sink_rate_ci`);
- the validation loss; on the Bigram-Backcopy task also the accuracy of the back-copy after a
  trigger and each head's attention on the first and the previous token by query class
  (:func:`~nopelens.probes.extreme_tokens.active_dormant_table`).

It answers: at which step does position become recoverable at each layer (the first checkpoint
whose CI lower bound clears the sweep's 0.9), and does the sink form before or after the task is
learned (first checkpoint whose sink-rate CI excludes 0, against the first checkpoint that has made
90 % of the validation-loss drop of the whole run)?

The run folder holds ``checkpoints/step-NNNNNN/`` (safetensors + JSON), ``train/`` (the resumable
training run), ``parts/step-NNNNNN/`` (each checkpoint's tables), ``dynamics.csv``,
``summary.md`` and ``dynamics.png``. An interrupted run resumes: training from its last checkpoint,
measuring from the last measured step.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from nopelens.models import Decoder, zoo
from nopelens.models.checkpoint import METADATA_FILE, TrainedModel, load_checkpoint, save_checkpoint
from nopelens.models.compat import moved_names
from nopelens.models.hooks import act_names
from nopelens.models.io import write_csv_atomic
from nopelens.models.threads import one_thread
from nopelens.models.training import validation_loss
from nopelens.probes import collect, probe_absolute_index, probe_relative_distance, resid_sites
from nopelens.probes.extreme_tokens import active_dormant_table
from nopelens.probes.sinks import GU_WINDOW, sink_rate_ci

from . import runs
from .subjects import from_trained
from .sweep.sites import score_sites

THRESHOLD = 0.9
"""A layer recovers a target when the 95 % CI lower bound of R^2 clears this (the sweep's bar)."""

LEARNED_SHARE = 0.9
"""The task counts as learned at the first checkpoint that has made this share of the run's
validation-loss drop (from the initialization to the last checkpoint)."""

TABLE_COLUMNS = ["step", "measure", "layer", "block", "head", "query_class", "value", "ci_low", "ci_high"]


@dataclass(frozen=True)
class DynamicsSettings:
    """What ``nopelens dynamics`` measures; equal settings give equal numbers on CPU.

    Attributes:
        model: a zoo name (its recipe is retrained).
        n_checkpoints: checkpoints kept, log-spaced from step 1 to the last, plus step 0.
        n_sequences, seq_len, n_boot, n_splits, seed: the evaluation sequences and probes.
        train_seed: the recipe's training seed.
        quick_steps: train only this many steps (smoke tests).
    """

    model: str
    n_checkpoints: int = 12
    n_sequences: int = 40
    seq_len: int = 64
    n_boot: int = 200
    n_splits: int = 5
    seed: int = 0
    train_seed: int = 0
    quick_steps: int | None = None

    def __post_init__(self) -> None:
        if self.n_checkpoints < 2:
            raise ValueError(
                f"--checkpoints must be >= 2 (the initialization and the last step), got {self.n_checkpoints}"
            )
        if self.n_sequences < self.n_splits:
            raise ValueError(f"{self.n_sequences} sequences are fewer than the {self.n_splits} folds")
        # checked before training: a refusal at measuring time would strand the trained checkpoints
        # behind a stamp that refuses the corrected rerun
        if isinstance(self.n_boot, bool) or not isinstance(self.n_boot, int) or self.n_boot < 1:
            raise ValueError(f"--n-boot must be a positive integer, got {self.n_boot!r}")
        for name in ("seed", "train_seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer in [0, 2^63), got {value!r}")


def checkpoint_steps(steps: int, n_checkpoints: int) -> list[int]:
    """Step 0 and ``n_checkpoints - 1`` log-spaced steps from 1 to ``steps`` (fewer when they collide).

    Example:
        >>> checkpoint_steps(1000, 5)
        [0, 1, 10, 100, 1000]
    """
    if steps < 1 or n_checkpoints < 2:
        raise ValueError(f"need steps >= 1 and n_checkpoints >= 2, got {steps}, {n_checkpoints}")
    spaced = (
        np.unique(np.round(np.geomspace(1, steps, n_checkpoints - 1)).astype(int)) if n_checkpoints > 2 else [steps]
    )
    return [0] + sorted(set(int(s) for s in spaced) | {steps})


def recipe_of(settings: DynamicsSettings):
    """The zoo recipe to retrain (shortened for ``quick_steps``)."""
    spec = zoo.recipe(settings.model, settings.train_seed)
    if settings.quick_steps is not None:
        spec = dataclasses.replace(spec, steps=settings.quick_steps)
    return spec


def step_dir(out: Path, kind: str, step: int) -> Path:
    return out / kind / f"step-{step:06d}"


def _snapshot_meta(spec, step: int) -> dict:
    kw = spec.train_kwargs
    return dict(
        task={"name": spec.task, "kwargs": dict(spec.task_kwargs)},
        train_lengths=[kw["min_len"], kw["max_len"]],
        steps=spec.steps,
        step=step,
        seed=spec.seed,
        complete=False,
        zoo_name=spec.name,
        zoo_recipe=spec.digest,
        snapshot_of_training_step=step,
    )


def train_with_snapshots(spec, steps: list[int], out: Path, progress: bool = True) -> None:
    """Train ``spec`` (resumably, in ``out/train``) and save the model at each of ``steps``."""
    missing = [s for s in steps if not (step_dir(out, "checkpoints", s) / METADATA_FILE).is_file()]
    if not missing:
        return
    if 0 in missing:  # the initialization train() starts from
        save_checkpoint(
            step_dir(out, "checkpoints", 0),
            TrainedModel(Decoder(spec.config, seed=spec.seed).eval(), _snapshot_meta(spec, 0)),
        )
    wanted = set(steps) - {0}

    def keep(step: int, loss: float, model) -> None:
        if step in wanted:
            save_checkpoint(step_dir(out, "checkpoints", step), TrainedModel(model, _snapshot_meta(spec, step)))

    if any(s > 0 for s in missing):
        trained = spec.train(checkpoint_dir=out / "train", progress=progress, callback=keep)
        last = step_dir(out, "checkpoints", spec.steps)
        if not (last / METADATA_FILE).is_file():  # train() returned a finished run without stepping
            save_checkpoint(last, TrainedModel(trained.model, _snapshot_meta(spec, spec.steps)))
        still = [s for s in steps if not (step_dir(out, "checkpoints", s) / METADATA_FILE).is_file()]
        if still:
            raise ValueError(
                f"{out / 'train'} holds a finished run but checkpoints {still} are missing; "
                "delete the run folder to train again"
            )


def measure_step(path: Path, settings: DynamicsSettings) -> pd.DataFrame:
    """The tidy rows (:data:`TABLE_COLUMNS`) of one checkpoint."""
    trained = load_checkpoint(path)
    step = int(trained.metadata["snapshot_of_training_step"])
    subject = from_trained(trained, settings.model, settings.n_sequences, settings.seq_len, settings.seed)
    layers = subject.n_layers
    residual, scores = resid_sites(layers), score_sites(subject.model, layers)
    patterns = act_names("pattern", layers)
    acts = collect(
        subject.model,
        subject.tokens,
        residual + scores + patterns,
        attention_mask=subject.attention_mask,
        batch_size=32,
    )
    common = dict(
        tasks=("regression",), controls=False, n_splits=settings.n_splits, n_boot=settings.n_boot, seed=settings.seed
    )
    rows = []
    absolute = probe_absolute_index(acts, sites=residual, **common)
    for _, r in absolute[(absolute["probe"] == "linear") & (absolute["metric"] == "r2")].iterrows():
        rows.append(
            dict(
                measure="absolute_r2", layer=int(r["layer"]), value=r["value"], ci_low=r["ci_low"], ci_high=r["ci_high"]
            )
        )
    if scores:
        relative = probe_relative_distance(
            acts, sites=[], feature_kinds=(), scores=scores, pairs_per_distance=min(64, settings.n_sequences), **common
        )
        for _, r in relative[(relative["probe"] == "linear") & (relative["metric"] == "r2")].iterrows():
            rows.append(
                dict(
                    measure="score_read_r2",
                    layer=int(r["layer"]),
                    block=int(r["layer"]) - 1,
                    value=r["value"],
                    ci_low=r["ci_low"],
                    ci_high=r["ci_high"],
                )
            )
    window = min(GU_WINDOW, int(subject.attention_mask.sum(-1).min()))
    rate = sink_rate_ci(acts, n_tokens=window, n_boot=settings.n_boot, seed=settings.seed)
    rows.append(dict(measure="sink_rate", value=rate[0], ci_low=rate[1], ci_high=rate[2]))
    task = trained.task
    low, high = trained.metadata["train_lengths"]
    rows.append(
        dict(measure="validation_loss", value=validation_loss(subject.model, task, low, high, seed=settings.train_seed))
    )
    if hasattr(task, "is_trigger"):
        rows += _backcopy_rows(subject, task, acts, settings)
    table = pd.DataFrame(rows).assign(step=step)
    return table.reindex(columns=TABLE_COLUMNS)


def _backcopy_rows(subject, task, acts, settings: DynamicsSettings) -> list[dict]:
    """Back-copy accuracy after triggers and each head's first-token / previous-token attention."""
    trigger = task.is_trigger(subject.tokens) & subject.loss_mask
    with torch.no_grad():
        logits = subject.model(subject.tokens, attention_mask=subject.attention_mask)
    right = (logits.argmax(-1) == subject.targets)[trigger].float()
    rows = [dict(measure="backcopy_accuracy", value=float(right.mean()))]
    real = subject.attention_mask.bool()
    flags = [task.is_trigger(row[mask]).numpy() for row, mask in zip(subject.tokens, real)]
    heads = active_dormant_table(acts, flags, n_boot=settings.n_boot, seed=settings.seed)
    for _, h in heads.iterrows():
        for name in ("first_mass", "previous_mass"):
            rows.append(
                dict(
                    measure=name,
                    block=int(h["block"]),
                    head=int(h["head"]),
                    query_class=h["query_class"],
                    value=h[name],
                    ci_low=h[f"{name}_ci_low"],
                    ci_high=h[f"{name}_ci_high"],
                )
            )
    return rows


def run(settings: DynamicsSettings, out: Path, progress: bool = True) -> pd.DataFrame:
    """Train, checkpoint and measure ``settings.model`` into the run folder ``out`` (its
    ``summary.md`` and ``dynamics.png`` are the CLI's: :func:`summary_markdown`,
    :func:`~nopelens.analyses.command_figures.dynamics_figure`).

    Returns:
        The ``dynamics.csv`` table, one row per (step, measure, layer or head).

    Raises:
        KeyError: on an unknown zoo name. ValueError: on settings that differ from those ``out``
            was made with.
    """
    spec = recipe_of(settings)
    runs.claim(out, "dynamics", dataclasses.asdict(settings))
    steps = checkpoint_steps(spec.steps, settings.n_checkpoints)
    say = (lambda text: print(f"nopelens: {text}", file=sys.stderr)) if progress else (lambda text: None)
    say(f"{settings.model}: training {spec.steps} steps, keeping checkpoints at steps {steps}")
    with one_thread():
        train_with_snapshots(spec, steps, out, progress)
        frames = []
        for step in steps:
            part = step_dir(out, "parts", step) / "dynamics.csv"
            if not part.is_file():
                say(f"{settings.model}: measuring step {step}")
                with torch.no_grad():
                    write_csv_atomic(measure_step(step_dir(out, "checkpoints", step), settings), part)
            frames.append(pd.read_csv(part))
    table = pd.concat(frames, ignore_index=True).assign(model=settings.model)
    write_csv_atomic(table, out / "dynamics.csv")
    return table


def first_steps(table: pd.DataFrame) -> dict:
    """The answers: first recovering step per layer and block, when the sink forms, when the task is learned.

    Returns:
        ``absolute`` and ``score_read`` (layer -> first step whose CI lower bound clears
        :data:`THRESHOLD`, or None), ``sink`` (first step whose sink-rate CI lower bound is > 0),
        ``learned`` (first step with :data:`LEARNED_SHARE` of the validation-loss drop made),
        ``backcopy`` (first step with back-copy accuracy >= 0.9; None when not measured or never).
    """

    def first(rows: pd.DataFrame, passed: pd.Series):
        hit = rows[passed]
        return int(hit["step"].min()) if len(hit) else None

    answers = {}
    for measure in ("absolute_r2", "score_read_r2"):
        rows = table[table["measure"] == measure]
        answers[measure] = {
            int(layer): first(group, group["ci_low"] >= THRESHOLD) for layer, group in rows.groupby("layer")
        }
    sink = table[table["measure"] == "sink_rate"]
    answers["sink"] = first(sink, sink["ci_low"] > 0)
    loss = table[table["measure"] == "validation_loss"].sort_values("step")
    start, end = float(loss["value"].iloc[0]), float(loss["value"].iloc[-1])
    answers["learned"] = first(loss, loss["value"] <= end + (1 - LEARNED_SHARE) * (start - end))
    copy = table[table["measure"] == "backcopy_accuracy"]
    answers["backcopy"] = first(copy, copy["value"] >= 0.9) if len(copy) else None
    return answers


def summary_markdown(table: pd.DataFrame, name: str) -> str:
    """The summary: the answers of :func:`first_steps` as sentences, then the numbers per checkpoint."""
    answers = first_steps(table)
    steps = sorted(table["step"].unique())
    lines = [
        f"# {name} through training",
        "",
        f"Checkpoints at steps {', '.join(map(str, steps))} (0 = initialization).",
        "",
    ]
    for measure, what in (
        ("absolute_r2", "absolute index (R² CI low ≥ 0.9) at layer"),
        ("score_read_r2", "head-score read of i − j (R² CI low ≥ 0.9) of block"),
    ):
        for layer, step in answers[measure].items():
            shown = layer - 1 if measure == "score_read_r2" else layer
            lines.append(f"- {what} {shown}: {'never' if step is None else f'from step {step}'}")
    learned = answers["learned"]
    lines.append(f"- task learned ({LEARNED_SHARE:.0%} of the validation-loss drop made): step {learned}")
    backcopy = answers["backcopy"]
    if "backcopy_accuracy" in set(table["measure"]):
        lines.append(
            f"- back-copy after triggers ≥ 90 % right: {'never' if backcopy is None else f'from step {backcopy}'}"
        )
    sink = answers["sink"]
    if sink is None:
        lines.append("- attention sink (sink-rate CI excludes 0): never")
    else:
        order = "before" if sink < learned else "after" if sink > learned else "at the same checkpoint as"
        lines.append(f"- attention sink (sink-rate CI excludes 0): from step {sink}, {order} the task is learned")
    wide = (
        table[
            table["measure"].isin(["absolute_r2", "score_read_r2", "sink_rate", "validation_loss", "backcopy_accuracy"])
        ]
        .assign(column=lambda t: t["measure"] + t["layer"].map(lambda v: "" if pd.isna(v) else f" {int(v)}"))
        .pivot_table(index="step", columns="column", values="value", sort=False)
    )
    lines += ["", wide.round(3).reset_index().to_markdown(index=False), ""]
    return "\n".join(lines)


__getattr__ = moved_names(__name__, moved={"dynamics_figure": "nopelens.analyses.command_figures"})
