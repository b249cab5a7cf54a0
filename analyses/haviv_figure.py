"""Rendering of ``nopelens compare haviv`` (:mod:`nopelens.analyses.haviv`): the side-by-side figure
and the Markdown summary. Only the CLI imports this module (analyses return tables)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from nopelens.models.io import write_text_atomic  # noqa: E402

from .figures import save_figure  # noqa: E402
from .haviv_paper import PROBE_FILE  # noqa: E402
from .palette import method_color  # noqa: E402

PROBE_STYLE = {"ridge": ("--", "s", "ridge MAD"), "mlp": ("-", "o", "MLP argmax MAD")}
PAPER_COLOR = "0.35"


def haviv_figure(table: pd.DataFrame) -> plt.Figure:
    """One panel per method, in its fixed colour (:mod:`~nopelens.analyses.palette`): MAD/chance by
    fraction of depth, ours (both probes, 95 % CI bands) at each model's trained window, the paper's
    1.3B curve in grey, and each probe's no-information floor (dotted)."""
    ours = table[(table["source"] == "nopelens") & (table["fit"] == "linear")]
    ours = ours[ours["n_positions"] == ours.groupby("model")["n_positions"].transform("max")]
    theirs = table[table["source"] == "haviv2022"]
    methods = list(dict.fromkeys([*ours["method"], *theirs["method"]]))
    fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3.4), sharey=True, squeeze=False)
    floors = {}
    for ax, method in zip(axes[0], methods):
        color = method_color(method)
        for probe, (line, marker, _) in PROBE_STYLE.items():
            rows = ours[(ours["method"] == method) & (ours["probe"] == probe)].sort_values("depth")
            if rows.empty:
                continue
            ax.plot(rows["depth"], rows["mad_chance"], line, marker=marker, color=color)
            ax.fill_between(rows["depth"], rows["ci_low"], rows["ci_high"], color=color, alpha=0.2)
            floors[probe] = rows["floor"].iloc[0]
            ax.axhline(floors[probe], color=color, linestyle=":", linewidth=1)
        paper = theirs[theirs["method"] == method].sort_values("depth")
        if not paper.empty:
            ax.plot(paper["depth"], paper["mad_chance"], color=PAPER_COLOR, marker=".")
        else:
            ax.text(0.5, 0.95, "not in the paper", transform=ax.transAxes, ha="center", va="top", fontsize=8)
        models = ", ".join(sorted(set(ours.loc[ours["method"] == method, "model"]))) or "no model measured"
        ax.set_title(f"{method}\n{models}", fontsize=9, color=color)
        ax.set_xlabel("layer / n_layers")
        ax.set_ylim(0, 1.6)
    axes[0][0].set_ylabel("MAD / chance")
    fig.legend(handles=_legend(floors), loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    return fig


def _legend(floors: dict) -> list[Line2D]:
    """Neutral legend entries: the colour is the panel's method, the line and marker the probe."""
    handles = [
        Line2D([], [], color="black", linestyle=line, marker=marker, label=f"ours, {label}")
        for probe, (line, marker, label) in PROBE_STYLE.items()
        if probe in floors
    ]
    handles.append(Line2D([], [], color=PAPER_COLOR, marker=".", label="Haviv et al. 2022, MLP"))
    if floors:
        values = ", ".join(f"{probe} {value:.2f}" for probe, value in floors.items())
        handles.append(
            Line2D([], [], color="black", linestyle=":", linewidth=1, label=f"no-information floor ({values})")
        )
    return handles


def _number(value, spec: str) -> str:
    return "n/a" if pd.isna(value) else format(value, spec)


def _cell(row) -> str:
    if pd.isna(row.get("ci_low")):
        return f"{row['mad_chance']:.3f}"
    return f"{row['mad_chance']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"


def side_by_side_markdown(table: pd.DataFrame) -> str:
    """Per model, one row per layer: ours with both probes (CIs; floors in the header), the
    controls (Hewitt & Liang's control task, shuffled labels), and the paper's value for the same
    method at the same fraction of depth."""
    ours = table[table["source"] == "nopelens"]
    ours = ours[ours["n_positions"] == ours.groupby("model")["n_positions"].transform("max")]
    lines = []
    for model, own in ours.groupby("model", sort=False):
        floors = {p: own.loc[own["probe"] == p, "floor"].iloc[0] for p in ("ridge", "mlp")}
        runs = int(own["n_train_seeds"].iloc[0])
        lines += [
            f"**{model}** ({own['method'].iloc[0]}, {int(own['n_positions'].iloc[0])} positions, "
            f"{int(own['n_sequences'].iloc[0])} of {int(own['n_sequences_drawn'].iloc[0])} windows kept"
            + (f"; the mean of {runs} training seeds, CIs over the runs and the windows)" if runs > 1 else ")"),
            "",
            f"| layer | depth | ridge MAD/chance (floor {floors['ridge']:.2f}) | MLP MAD/chance (floor "
            f"{floors['mlp']:.2f}) | control task: ridge / MLP | shuffled labels: ridge / MLP "
            "| Haviv et al. 2022 at that depth |",
            "|---|---|---|---|---|---|---|",
        ]
        for layer, rows in own.groupby("layer"):
            get = {(r["probe"], r["fit"]): r for _, r in rows.iterrows()}
            ridge, mlp = get[("ridge", "linear")], get[("mlp", "linear")]
            control, shuffled = (
                " / ".join(f"{get[(p, fit)]['mad_chance']:.2f}" for p in ("ridge", "mlp"))
                for fit in ("control", "shuffled")
            )
            theirs = mlp["paper_mad_chance"]
            paper = (
                f"{theirs:.3f} (layer {int(mlp['paper_layer'])} of 24)" if not np.isnan(theirs) else "not in the paper"
            )
            lines.append(
                f"| {layer} | {mlp['depth']:.2f} | {_cell(ridge)} | {_cell(mlp)} | {control} | {shuffled} | {paper} |"
            )
        lines.append("")
    lines.append(
        "MAD/chance: the probe's mean absolute distance from the true position over that of a random guess "
        "(0: exact). Floor: what a probe that reads nothing scores. Control task: the same probe fitted to a "
        "fixed random position per token (what it reads from token identity alone: near 0 means it can map "
        "tokens to any label; the position is not such a map, since a token occurs at every position). "
        "Shuffled labels: fitted to shuffled positions (the chance of this data)."
    )
    lines.append("")
    lines.append(f"Paper values: MAD / 341.33 (chance at 1,024 tokens) from `{PROBE_FILE}`.")
    return "\n".join(lines)


def summary_markdown(tables: dict[str, pd.DataFrame]) -> str:
    """The run's summary.md: side-by-side, losses, context-length axis, claims."""
    loss = tables["losses"]
    loss_lines = [
        "| model | training seed | method | validation bits/byte | unseen validation bits/byte | training levelled off "
        "(last tenth / tenth before) | gap to learned (all / unseen) | paper ppl The Pile | paper ppl WikiText-103 | "
        "paper gap to learned (bits, The Pile) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in loss.iterrows():
        levelled = (
            "n/a"
            if pd.isna(r["train_loss_last"])
            else f"{'yes' if r['levelled_off'] else 'no'} ({r['train_loss_last']:.3f} / {r['train_loss_before']:.3f})"
        )
        cells = [
            _number(r["bits_per_byte"], ".3f"),
            _number(r["unseen_bits_per_byte"], ".3f") if r["unseen_bytes"] else "no document unseen",
            levelled,
            f"{_number(r['gap_to_learned'], '+.1%')} / {_number(r['unseen_gap_to_learned'], '+.1%')}",
            _number(r["paper_ppl_the_pile"], ".2f"),
            _number(r["paper_ppl_wikitext-103"], ".2f"),
            _number(r["paper_gap_the_pile"], "+.2%"),
        ]
        loss_lines.append(f"| {r['model']} | {r['train_seed']} | {r['method']} | " + " | ".join(cells) + " |")
    context = tables["context"]
    context_lines = [
        "| model | window (bytes) | probe | first layer with MAD/chance CI upper end <= 0.1 | depth | each training "
        "seed's own |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in context.iterrows():
        first = (
            "not measured (past the model's window)"
            if not r["measured"]
            else ("none" if r["first_layer"] < 0 else str(int(r["first_layer"])))
        )
        depth = "" if pd.isna(r["depth"]) else f"{r['depth']:.2f}"
        each = r["seed_first_layers"].replace("-1", "none")
        context_lines.append(f"| {r['model']} | {int(r['length'])} | {r['probe']} | {first} | {depth} | {each} |")
    claims = tables["claims"]
    claim_lines = ["| claim | paper | ours | verdict |", "|---|---|---|---|"]
    claim_lines += [f"| {r['claim']} | {r['paper']} | {r['ours']} | {r['verdict']} |" for _, r in claims.iterrows()]
    return "\n".join(
        [
            "# nopelens compare haviv",
            "",
            "## MAD/chance by layer",
            "",
            side_by_side_markdown(tables["haviv"]),
            "",
            "## Validation loss",
            "",
            *loss_lines,
            "",
            f"Unseen: the {_unseen_bytes(loss)} validation bytes whose documents share no 64-byte string with the "
            "training text (the others are mostly copied there); the paper's perplexities are on unseen text.",
            "",
            "![training loss](training.png)",
            "",
            "Each model's training loss in bits per byte (the mean over a trailing window of "
            f"{_window(tables['training'])} steps) against the step; shaded: the two last tenths of the run, "
            "which the levelling-off rule compares.",
            "",
            "## Context length (NoPE)",
            "",
            *context_lines,
            "",
            context_sentence(context),
            "",
            "## Claims",
            "",
            *claim_lines,
            "",
        ]
    )


def _unseen_bytes(loss: pd.DataFrame) -> str:
    return "/".join(f"{int(b):,}" for b in sorted(set(loss["unseen_bytes"]))) if len(loss) else "0"


def _window(training: pd.DataFrame) -> str:
    return "n/a" if training.empty else "/".join(str(w) for w in sorted(set(training["window"])))


def context_sentence(context: pd.DataFrame) -> str:
    """What the context-length axis found, in one sentence, either way."""
    rows = context[(context["probe"] == "mlp") & context["measured"]].sort_values("length")
    if len(rows) < 2:
        return "Only one window length was measured: the context-length axis says nothing yet."
    layers = [int(v) for v in rows["first_layer"]]
    pairs = ", ".join(f"{'none' if l < 0 else l} at {int(n)} bytes" for l, n in zip(layers, rows["length"]))
    onset = [math.inf if l < 0 else l for l in layers]  # none: past the last layer
    start = "With the MLP probe, the first layer whose MAD/chance CI upper end is <= 0.1"
    if len(set(onset)) == 1:
        return f"{start} does not move with the window ({pairs})."
    if onset == sorted(onset):
        return f"{start} moves deeper as the window grows ({pairs})."
    if onset == sorted(onset, reverse=True):
        return f"{start} comes earlier as the window grows ({pairs})."
    return f"{start} does not move monotonically with the window ({pairs})."


def training_figure(training: pd.DataFrame) -> plt.Figure:
    """Each model's training loss (bits per byte, trailing mean) against the step, in its method's
    colour, the two tenths the levelling-off rule compares shaded."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    labelled = set()  # one legend entry per model; its other training seeds share its colour
    for (model, _), rows in training.groupby(["model", "train_seed"], sort=False):
        label = None if model in labelled else model
        labelled.add(model)
        ax.plot(rows["step"], rows["train_bits_per_byte"], color=method_color(rows["method"].iloc[0]), label=label)
    if len(training):
        for tenth, shade in (("before", "0.92"), ("last", "0.82")):
            steps = training.loc[training["tenth"] == tenth, "step"]
            if len(steps):
                ax.axvspan(steps.min(), steps.max(), color=shade, zorder=0)
        low, high = training["train_bits_per_byte"].quantile([0.0, 0.9])
        ax.set_ylim(low - 0.1 * (high - low), high)
        ax.legend(fontsize=8)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (bits/byte)")
    fig.tight_layout()
    return fig


def write_report(folder: str | Path, tables: dict[str, pd.DataFrame], quick: bool = False) -> list[Path]:
    """Render the tables into ``folder``: haviv.md (the side-by-side), summary.md, haviv.png/.svg
    and training.png/.svg (:func:`training_figure`);
    ``quick``: summary.md opens by saying its numbers are a smoke test's."""
    folder = Path(folder)
    label = (
        "**Quick mode (`--quick`): a smoke test at toy size; its numbers and verdicts are not meant to be read.**\n\n"
    )
    written = [
        write_text_atomic(folder / "haviv.md", side_by_side_markdown(tables["haviv"]) + "\n"),
        write_text_atomic(folder / "summary.md", (label if quick else "") + summary_markdown(tables)),
    ]
    for name, fig in (("haviv", haviv_figure(tables["haviv"])), ("training", training_figure(tables["training"]))):
        written += save_figure(fig, folder / name)
        plt.close(fig)
    return written
