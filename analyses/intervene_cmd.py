"""``nopelens intervene MODEL``: sink ablation, index-direction interventions and position patching.

Writes a run folder: ``sink_probes.csv`` (every re-probe, clean and ablated, with ``delta``),
``sink_behavior.csv`` (loss and exact match per ablation, with paired CIs), ``directions.csv``,
``patching.csv``, ``summary.csv`` (one row per ablated block), the figure ``intervene.png``/``.svg``
and ``run.json``. Each table is written atomically once it is done, so an interrupted run resumes
from the tables already there (same settings only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from nopelens.models.io import read_json, write_csv_atomic, write_json_atomic

from . import intervene as iv
from .subjects import Subject, check_spec, resolve

MODEL_HELP = "zoo name, checkpoint directory, hf:DIR (local HF model), circuit or untrained-nope"


@dataclass(frozen=True)
class InterveneSettings:
    """What ``nopelens intervene`` measures; equal settings give equal numbers on CPU."""

    model: str
    n_sequences: int = 80  # the sweep's: its compact sink ablation then gives the same numbers
    seq_len: int = 64
    seed: int = 0
    n_splits: int = 5
    n_boot: int = 200
    modes: tuple[str, ...] = iv.SINK_MODES
    shift: int = 4
    quick_steps: int | None = None

    def probes(self) -> iv.ProbeSettings:
        return iv.ProbeSettings(n_splits=self.n_splits, n_boot=self.n_boot, seed=self.seed)


def sink_summary(probes: pd.DataFrame, behavior: pd.DataFrame) -> pd.DataFrame:
    """One row per (mode, ablated block) l: absolute-index R^2 and accuracy at layer l + 1, the q.k
    distance read of block l + 1 (``qk_*``; none after the last block), each clean -> ablated, and the change in loss and exact match."""
    linear = probes[(probes["probe"] == "linear") & (probes["condition"] != "clean")]
    absolute = (linear["target"] == "absolute_index") & (linear["layer"] == linear["ablated_block"] + 1)
    next_read = (linear["target"] == "relative_distance") & (linear["block"] == linear["ablated_block"] + 1)
    linear = linear[absolute | next_read]
    rows = []
    for (mode, block), group in linear.groupby(["condition", "ablated_block"], sort=False):
        row = dict(condition=mode, ablated_block=int(block), next_layer=int(block) + 1)
        for name, target, metric, features in (("abs_r2", "absolute_index", "r2", "token"),
                                               ("abs_acc", "absolute_index", "accuracy", "token"),
                                               ("qk_r2", "relative_distance", "r2", None)):
            hit = group[(group["target"] == target) & (group["metric"] == metric)]
            if features is not None:
                hit = hit[hit["features"] == features]
            if len(hit):
                first = hit.iloc[0]
                row.update({f"{name}_clean": first["clean_value"], f"{name}": first["value"],
                            f"{name}_ci_low": first["ci_low"], f"{name}_ci_high": first["ci_high"],
                            f"{name}_delta": first["delta"]})
        measured = behavior[(behavior["condition"] == mode) & (behavior["ablated_block"] == block)]
        for _, b in measured.iterrows():
            if b.get("status") == "measured":
                row.update({f"{b['metric']}_delta": b["delta"], f"{b['metric']}_delta_ci_low": b["delta_ci_low"],
                            f"{b['metric']}_delta_ci_high": b["delta_ci_high"]})
        rows.append(row)
    return pd.DataFrame(rows)


def run(settings: InterveneSettings, out: Path, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Measure ``settings.model`` and write (or resume) the run folder ``out``.

    Raises:
        ValueError: on settings that differ from the ones ``out`` was made with, fewer sequences
            than folds, or as :func:`~nopelens.analyses.subjects.resolve`.
        KeyError, FileNotFoundError: on a model spec that names nothing.
    """
    check_spec(settings.model)
    if settings.n_sequences < settings.n_splits:
        raise ValueError(f"{settings.n_sequences} sequences are fewer than the {settings.n_splits} folds; "
                         f"use --n-sequences {settings.n_splits} or more")
    for mode in settings.modes:
        if mode not in iv.SINK_MODES:
            raise ValueError(f"unknown sink ablation mode {mode!r}; choose from {', '.join(iv.SINK_MODES)}")
    if settings.shift == 0:
        raise ValueError("--shift must be non-zero (it is the k of 'as if the index were i + k')")
    _claim(out, settings)
    say = (lambda text: print(f"nopelens: {text}", file=sys.stderr)) if progress else (lambda text: None)
    say(f"{settings.model}: loading")
    subject = resolve(settings.model, settings.n_sequences, settings.seq_len, settings.seed, progress,
                      settings.quick_steps)
    tables: dict[str, pd.DataFrame] = {}
    with torch.no_grad():
        tables.update(_cached(out, ("sink_probes", "sink_behavior"), lambda: _sink(subject, settings), say, "sink ablation"))
        tables.update(_cached(out, ("directions",), lambda: _directions(subject, settings), say, "index directions"))
        tables.update(_cached(out, ("patching",), lambda: _patching(subject, settings), say, "position patching"))
    tables["summary"] = sink_summary(tables["sink_probes"], tables["sink_behavior"]).assign(model=subject.name)
    write_csv_atomic(tables["summary"], out / "summary.csv")
    from . import report

    report.save_figure(intervention_figure(tables, subject.name), out / "intervene")
    return tables


def _sink(subject: Subject, settings: InterveneSettings) -> tuple[pd.DataFrame, pd.DataFrame]:
    probes, behavior = iv.sink_ablation(subject.model, subject.tokens, subject.attention_mask, subject.n_layers,
                                        settings.probes(), settings.modes, targets=subject.targets,
                                        loss_mask=subject.loss_mask)
    return probes.assign(model=subject.name), behavior.assign(model=subject.name)


def _directions(subject: Subject, settings: InterveneSettings) -> tuple[pd.DataFrame]:
    if subject.n_layers < 2:
        return (pd.DataFrame({"note": ["one block: no layer has a later layer to read"]}),)
    table = iv.direction_interventions(subject.model, subject.tokens, subject.attention_mask, subject.n_layers,
                                       settings.probes(), shifts=(settings.shift,), targets=subject.targets,
                                       loss_mask=subject.loss_mask)
    return (table.assign(model=subject.name),)


def _patching(subject: Subject, settings: InterveneSettings) -> tuple[pd.DataFrame]:
    if not bool(subject.attention_mask.all()):
        return (pd.DataFrame({"note": ["padded sequences: position patching needs sequences without padding"]}),)
    table = iv.position_patching(subject.model, subject.tokens, subject.n_layers, settings.probes(),
                                 keep_first=subject.has_bos)
    return (table.assign(model=subject.name),)


def _cached(out: Path, names: tuple[str, ...], compute, say, label: str) -> dict[str, pd.DataFrame]:
    paths = [out / f"{name}.csv" for name in names]
    if all(path.is_file() for path in paths):
        say(f"{label}: already in {out}, reusing")
        return {name: pd.read_csv(path) for name, path in zip(names, paths)}
    say(label)
    frames = compute()
    for frame, path in zip(frames, paths):
        write_csv_atomic(frame, path)
    return dict(zip(names, frames))


def _claim(out: Path, settings: InterveneSettings) -> None:
    record = dataclasses.asdict(settings)
    stamp = out / "run.json"
    if stamp.is_file():
        previous = read_json(stamp)
        if previous != json_ready(record):
            raise ValueError(f"{out} holds an intervene run with other settings ({previous}); use another --out")
        return
    write_json_atomic(record, stamp)


def json_ready(record: dict) -> dict:
    """The record as JSON reads it back (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in record.items()}


def intervention_figure(tables: dict[str, pd.DataFrame], name: str):
    """Three panels: sink ablation (next-layer R^2 change per block), shift carried per read
    layer, and the share of the index that moves with a patched state per layer."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8))
    summary = tables["summary"]
    if "abs_r2_delta" in summary:
        sns.barplot(data=summary, x="ablated_block", y="abs_r2_delta", hue="condition", ax=axes[0], errorbar=None)
    axes[0].set(title="sink ablated in block l:\nchange in abs. index R² at layer l + 1", xlabel="ablated block",
                ylabel="Δ R² (refitted probe)", ylim=(-1.05, 0.2))
    directions = tables["directions"]
    if "read_shift" in directions:
        shifted = directions[directions["intervention"] == "shift"]
        shifted = shifted.assign(carried=shifted["read_shift"] / shifted["k"], layer=shifted["layer"].astype(str))
        sns.lineplot(data=shifted, x="read_layer", y="carried", hue="layer", marker="o", ax=axes[1])
    axes[1].set(title="index direction shifted by k at layer l:\nshift a clean probe reads / k", xlabel="read layer",
                ylabel="read shift / k")
    patching = tables["patching"]
    if "moved" in patching:
        sns.pointplot(data=patching, x="layer", y="moved", ax=axes[2], errorbar=None)
    axes[2].set(title="state patched from a shifted copy:\nshare of the index that moves (last layer)",
                xlabel="patched layer (resid_pre)", ylabel="moved (0 = recomputed, 1 = carried)")
    fig.subplots_adjust(wspace=0.4)
    fig.suptitle(f"{name}: does the model make and use the position a probe reads?", y=1.06)
    return fig


def run_intervene(args: argparse.Namespace) -> int:
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes:
        raise ValueError(f"--modes lists no sink ablation; choose from {', '.join(iv.SINK_MODES)}")
    settings = InterveneSettings(model=args.model, modes=modes, shift=args.shift,
                                 quick_steps=30 if args.quick else None,
                                 **{k: getattr(args, k) for k in ("n_sequences", "seq_len", "seed", "n_boot")
                                    if getattr(args, k) is not None})
    out = Path(args.out or f"runs/intervene-{''.join(c if c.isalnum() or c in '-_' else '_' for c in args.model)}")
    tables = run(settings, out, progress=not args.quiet)
    columns = [c for c in ("condition", "ablated_block", "abs_r2_clean", "abs_r2", "abs_acc_clean", "abs_acc",
                           "qk_r2_clean", "qk_r2", "loss_delta", "exact_match_delta") if c in tables["summary"]]
    print(tables["summary"][columns].round(3).to_string(index=False))
    refused = tables["sink_behavior"]
    if "status" in refused:
        for _, row in refused[refused["status"] == "not_applicable"].iterrows():
            print(f"not applicable: {row['condition']} in block {int(row['ablated_block'])}: {row['note']}")
    print(f"\nwrote {out}/summary.csv, sink_probes.csv, sink_behavior.csv, directions.csv, patching.csv, intervene.png")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "intervene", help="causal tests: does the probed position come from the attention sink, and is it used?",
        description="Ablate the first token in each block (remove its key, or mean its value) and re-probe later "
        "layers; shift or project out the probe's index direction; patch states from a shifted copy.",
        epilog="examples:\n  nopelens intervene circuit\n  nopelens intervene text-nope-4l --out runs/iv-nope",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("--out", help="run folder (default runs/intervene-<model>); reruns resume")
    parser.add_argument("--modes", default=",".join(iv.SINK_MODES), help="sink ablations, comma list (default both)")
    parser.add_argument("--shift", type=int, default=4, help="k of the index-direction shift (default 4)")
    parser.add_argument("--n-sequences", type=int, help="evaluation sequences (default 80, as the sweep)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 64)")
    parser.add_argument("--n-boot", type=int, help="bootstrap replicates (default 200)")
    parser.add_argument("--seed", type=int, help="seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="zoo models trained for 30 steps (smoke tests)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(func=run_intervene)


def sink_ablation_figure(table: pd.DataFrame):
    """The sweep's figure: per model and block, the drop in next-layer absolute-index R^2."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    measured = table[table["status"] == "measured"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    if not measured.empty:
        sns.barplot(data=measured, x="block", y="drop", hue="model", ax=ax, errorbar=None)
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1))
    low = min(-0.1, float(measured["drop"].min()) - 0.05) if not measured.empty else -0.1
    ax.set(xlabel="block l whose first key is removed", ylabel="R² drop at layer l + 1", ylim=(low, 1.05),
           title="Sink ablation: how much absolute index at the next layer\ncomes from the first token")
    return fig


def sink_ablation_markdown(table: pd.DataFrame) -> str:
    """The sweep's compact table: one row per model, one column per block (R² clean → ablated)."""
    def cell(row) -> str:
        if row["status"] != "measured":
            return "n/a"
        return f"{row['r2_clean']:.2f} → {row['r2_ablated']:.2f}"

    grid = table.assign(cell=table.apply(cell, axis=1)).pivot(index="model", columns="block", values="cell")
    grid.columns = [f"block {int(b)}" for b in grid.columns]
    return grid.reset_index().fillna("").to_markdown(index=False)
