"""Per-layer linear probes of absolute position for any zoo model or checkpoint.

At each layer (0 = embeddings, l + 1 = output of block l) a linear probe reads the position id from
the residual stream, cross-validated over whole sequences: accuracy (classes) and R² (a value),
with bootstrap 95 % CIs, next to the same probe on shuffled labels (the chance level of this data).

    python examples/probe_layers.py text-nope-4l            # a zoo model (trained on first use)
    python examples/probe_layers.py circuit                 # the hand-built Theorem 1/2 circuit
    python examples/probe_layers.py runs/train/checkpoint   # a checkpoint of `nopelens train`

Writes ``probe_layers.png``/``.svg`` (the plot) and ``probe_layers.csv`` (every score) into --out
and says where. The defaults are the sweep's (80 sequences of 64 tokens, 5 folds, 200 bootstrap
replicates, seed 0), so its numbers are the ``absolute_acc`` and ``absolute_r2`` curves of
``nopelens probe MODEL``. Bad input (an unknown model, a missing directory) is one line on stderr
and exit code 2, as on the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

from nopelens.analyses.cli import OneLineParser, guarded
from nopelens.analyses.figures import save_figure
from nopelens.analyses.subjects import resolve
from nopelens.analyses.sweep.settings import SweepSettings
from nopelens.models.io import write_csv_atomic
from nopelens.probes import collect, probe_absolute_index, resid_sites

SWEEP = SweepSettings(models=())
"""The sweep's default settings, which this example uses."""

PANELS = (("classification", "accuracy", "accuracy"), ("regression", "r2", "R²"))


def probe_plot(table, title: str) -> plt.Figure:
    """Accuracy and R² per layer: the linear probe with its CI band, and the shuffled-label probe."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (task, metric, label) in zip(axes, PANELS):
        rows = table[(table.task == task) & (table.metric == metric) & (table.split == "grouped")]
        linear, shuffled = rows[rows.probe == "linear"], rows[rows.probe == "shuffled"]
        sns.lineplot(data=linear, x="layer", y="value", marker="o", ax=ax, label="linear probe")
        ax.fill_between(linear.layer, linear.ci_low, linear.ci_high, alpha=0.25)
        sns.lineplot(data=shuffled, x="layer", y="value", ax=ax, color="0.5", linestyle="--", label="shuffled labels")
        ax.set(
            xlabel="layer (0 = embeddings)",
            ylabel=label,
            title=f"absolute index: {label}",
            ylim=(min(-0.1, rows.value.min() - 0.05), 1.05),
        )
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> list[Path]:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a zoo name (nopelens train --list), 'circuit', or a checkpoint directory")
    parser.add_argument(
        "--n-sequences",
        type=int,
        default=SWEEP.n_sequences,
        help=f"evaluation sequences, split by sequence (default {SWEEP.n_sequences}, as the sweep)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=SWEEP.seq_len,
        help=f"tokens per sequence, BOS included (default {SWEEP.seq_len}, as the sweep)",
    )
    parser.add_argument(
        "--n-boot", type=int, default=SWEEP.n_boot, help=f"bootstrap replicates of the CIs (default {SWEEP.n_boot})"
    )
    parser.add_argument(
        "--quick-steps", type=int, default=None, help="train a zoo model for only this many steps (smoke test)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/examples"), help="folder to write into (default runs/examples)"
    )
    args = parser.parse_args(argv)

    subject = resolve(
        args.model, args.n_sequences, args.seq_len, seed=SWEEP.seed, quick_steps=args.quick_steps, progress=False
    )
    acts = collect(
        subject.model,
        subject.tokens,
        resid_sites(subject.n_layers),
        attention_mask=subject.attention_mask,
        batch_size=32,
    )
    table = probe_absolute_index(acts, n_splits=SWEEP.n_splits, n_boot=args.n_boot, seed=SWEEP.seed)
    scores = table[(table.probe == "linear") & (table.metric.isin(["accuracy", "r2"]))]
    print(scores.pivot_table(index="layer", columns="metric", values="value").round(3).to_string())
    fig = probe_plot(table, f"{subject.name}: where absolute position becomes linearly readable")
    paths = save_figure(fig, args.out / "probe_layers") + [write_csv_atomic(table, args.out / "probe_layers.csv")]
    print("wrote " + ", ".join(str(path) for path in paths))
    return paths


if __name__ == "__main__":
    sys.exit(guarded(main, "probe_layers.py"))
