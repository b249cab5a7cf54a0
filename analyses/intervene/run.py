"""``nopelens intervene``'s run folder: :func:`run_intervene` measures a model and writes
``sink_probes.csv`` (every re-probe, clean and ablated, with ``delta``), ``sink_behavior.csv``
(loss and exact match per ablation, with paired CIs), ``directions.csv``, ``patching.csv``,
``summary.csv`` (one row per ablated block) and the stamp ``intervene.json``; the CLI then draws
the figure ``intervene.png``/``.svg`` from the tables
(:func:`~nopelens.analyses.command_figures.intervention_figure`). Each table is written atomically
once it is done, so an interrupted run resumes from the tables already there (same settings only).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from nopelens.models.io import write_csv_atomic

from .. import runs
from ..subjects import Subject, check_spec, resolve
from .directions import direction_interventions
from .hooks import SINK_MODES
from .measure import ProbeSettings
from .patching import position_patching
from .sink import sink_ablation


@dataclass(frozen=True)
class InterveneSettings:
    """What ``nopelens intervene`` measures; equal settings give equal numbers on CPU."""

    model: str
    n_sequences: int = 80  # the sweep's: its compact sink ablation then gives the same numbers
    seq_len: int = 64
    seed: int = 0
    n_splits: int = 5
    n_boot: int = 200
    modes: tuple[str, ...] = SINK_MODES
    shift: int = 4
    quick_steps: int | None = None

    def probes(self) -> ProbeSettings:
        return ProbeSettings(n_splits=self.n_splits, n_boot=self.n_boot, seed=self.seed)


def sink_summary(probes: pd.DataFrame, behavior: pd.DataFrame) -> pd.DataFrame:
    """One row per (mode, ablated block) l: absolute-index R^2 and accuracy at layer l + 1, the q.k
    distance read of block l + 1 (``qk_*``; none after the last block), each clean -> ablated, and
    the change in loss and exact match."""
    linear = probes[(probes["probe"] == "linear") & (probes["condition"] != "clean")]
    absolute = (linear["target"] == "absolute_index") & (linear["layer"] == linear["ablated_block"] + 1)
    next_read = (linear["target"] == "relative_distance") & (linear["block"] == linear["ablated_block"] + 1)
    linear = linear[absolute | next_read]
    rows = []
    for (mode, block), group in linear.groupby(["condition", "ablated_block"], sort=False):
        row = dict(condition=mode, ablated_block=int(block), next_layer=int(block) + 1)
        for name, target, metric, features in (
            ("abs_r2", "absolute_index", "r2", "token"),
            ("abs_acc", "absolute_index", "accuracy", "token"),
            ("qk_r2", "relative_distance", "r2", None),
        ):
            hit = group[(group["target"] == target) & (group["metric"] == metric)]
            if features is not None:
                hit = hit[hit["features"] == features]
            if len(hit):
                first = hit.iloc[0]
                row.update(
                    {
                        f"{name}_clean": first["clean_value"],
                        f"{name}": first["value"],
                        f"{name}_ci_low": first["ci_low"],
                        f"{name}_ci_high": first["ci_high"],
                        f"{name}_delta": first["delta"],
                    }
                )
        measured = behavior[(behavior["condition"] == mode) & (behavior["ablated_block"] == block)]
        for _, b in measured.iterrows():
            if b.get("status") == "measured":
                row.update(
                    {
                        f"{b['metric']}_delta": b["delta"],
                        f"{b['metric']}_delta_ci_low": b["delta_ci_low"],
                        f"{b['metric']}_delta_ci_high": b["delta_ci_high"],
                    }
                )
        rows.append(row)
    return pd.DataFrame(rows)


def run_intervene(settings: InterveneSettings, out: Path, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Measure ``settings.model`` and write (or resume) the run folder ``out``.

    Raises:
        ValueError: on settings that differ from the ones ``out`` was made with, fewer sequences
            than folds, or as :func:`~nopelens.analyses.subjects.resolve`.
        KeyError, FileNotFoundError: on a model spec that names nothing.

    Returns:
        The tables by file stem (``sink_probes``, ``sink_behavior``, ``directions``, ``patching``,
        ``summary``), each with the subject's name in ``model``.
    """
    check_spec(settings.model)
    if settings.n_sequences < settings.n_splits:
        raise ValueError(
            f"{settings.n_sequences} sequences are fewer than the {settings.n_splits} folds; "
            f"use --n-sequences {settings.n_splits} or more"
        )
    for mode in settings.modes:
        if mode not in SINK_MODES:
            raise ValueError(f"unknown sink ablation mode {mode!r}; choose from {', '.join(SINK_MODES)}")
    if settings.shift == 0:
        raise ValueError("--shift must be non-zero (it is the k of 'as if the index were i + k')")
    if settings.seq_len < 4:  # shifted_copy: BOS, at least one dropped token and two more
        raise ValueError(f"--seq-len {settings.seq_len} is too short for position patching: it needs at least 4 tokens")
    runs.claim(out, "intervene", dataclasses.asdict(settings))
    say = (lambda text: print(f"nopelens: {text}", file=sys.stderr)) if progress else (lambda text: None)
    say(f"{settings.model}: loading")
    subject = resolve(
        settings.model, settings.n_sequences, settings.seq_len, settings.seed, progress, settings.quick_steps
    )
    tables: dict[str, pd.DataFrame] = {}
    with torch.no_grad():
        tables.update(
            runs.cached_tables(
                out, ("sink_probes", "sink_behavior"), lambda: _sink(subject, settings, progress), say, "sink ablation"
            )
        )
        tables.update(
            runs.cached_tables(
                out, ("directions",), lambda: _directions(subject, settings, progress), say, "index directions"
            )
        )
        tables.update(
            runs.cached_tables(
                out, ("patching",), lambda: _patching(subject, settings, progress), say, "position patching"
            )
        )
    tables["summary"] = sink_summary(tables["sink_probes"], tables["sink_behavior"]).assign(model=subject.name)
    write_csv_atomic(tables["summary"], out / "summary.csv")
    return tables


def _sink(subject: Subject, settings: InterveneSettings, progress: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    probes, behavior = sink_ablation(
        subject.model,
        subject.tokens,
        subject.attention_mask,
        subject.n_layers,
        settings.probes(),
        settings.modes,
        targets=subject.targets,
        loss_mask=subject.loss_mask,
        progress=progress,
        subject=subject,
    )
    return probes.assign(model=subject.name), behavior.assign(model=subject.name)


def _directions(subject: Subject, settings: InterveneSettings, progress: bool) -> tuple[pd.DataFrame]:
    if subject.n_layers < 2:
        return (pd.DataFrame({"note": ["one block: no layer has a later layer to read"]}),)
    table = direction_interventions(
        subject.model,
        subject.tokens,
        subject.attention_mask,
        subject.n_layers,
        settings.probes(),
        shifts=(settings.shift,),
        targets=subject.targets,
        loss_mask=subject.loss_mask,
        progress=progress,
    )
    return (table.assign(model=subject.name),)


def _patching(subject: Subject, settings: InterveneSettings, progress: bool) -> tuple[pd.DataFrame]:
    if not bool(subject.attention_mask.all()):
        return (pd.DataFrame({"note": ["padded sequences: position patching needs sequences without padding"]}),)
    table = position_patching(
        subject.model,
        subject.tokens,
        subject.n_layers,
        settings.probes(),
        keep_first=subject.has_bos,
        progress=progress,
    )
    return (table.assign(model=subject.name),)
