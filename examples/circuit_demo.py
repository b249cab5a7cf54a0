"""A hand-built NoPE circuit (Kazemnejad et al. 2023, App. C) read through TransformerLens hooks.

Block 0 is Theorem 1's counter: a uniform causal head reading a BOS-only value writes 1/(i+1)
at position i, and its MLP turns that into i. Block 1 is Theorem 2's distance head: from i in the
residual stream it scores -m (i - j), so its pattern is the pattern of an ALiBi head of slope m,
although the model has no position embedding at all.

    python examples/circuit_demo.py --n-ctx 64 --slope 0.5

Writes ``circuit_demo.png``/``.svg`` (the counter next to 1/(i+1); the head's pattern next to the
ALiBi pattern) and ``circuit_demo.csv`` (the counter per position) into --out, and says where.
Bad input is one line on stderr and exit code 2, as on the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from nopelens import circuits
from nopelens.analyses.cli import OneLineParser, guarded
from nopelens.analyses.figures import save_figure
from nopelens.models.hooks import act_name
from nopelens.models.io import write_csv_atomic


def main(argv: list[str] | None = None) -> list[Path]:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-ctx", type=int, default=64, help="positions, BOS at 0 (default 64)")
    parser.add_argument(
        "--slope", type=float, default=0.5, help="the ALiBi slope m the distance head reproduces (default 0.5)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/examples"), help="folder to write into (default runs/examples)"
    )
    args = parser.parse_args(argv)
    if args.n_ctx < 2:
        raise ValueError(f"--n-ctx must be >= 2 (BOS and one token), got {args.n_ctx}")

    model = circuits.distance(args.n_ctx, slope=args.slope)
    tokens = circuits.circuit_tokens(model, seed=0)  # BOS, then random tokens
    _, cache = model.run_with_cache(tokens)

    i = np.arange(args.n_ctx)
    resid = cache[act_name("resid_post", 0)][0]
    counter = resid[:, model.circuit.counter_dim].numpy()
    position = resid[:, model.circuit.position_dim].numpy()
    uniform = cache[act_name("pattern", 0)][0, 0].numpy()  # the counter head: 1/(i+1) on each visible key
    pattern = cache[act_name("pattern", 1)][0, 0].numpy()
    alibi = circuits.alibi_reference_pattern(args.n_ctx, args.slope).numpy()
    table = pd.DataFrame(
        {
            "position": i,
            "counter": counter,
            "one_over_i_plus_1": 1 / (i + 1),
            "bos_weight": uniform[:, 0],
            "position_dim": position,
        }
    )
    print(f"max |counter - 1/(i+1)| = {np.abs(counter - 1 / (i + 1)).max():.2e}")
    print(f"max |position dim - i|   = {np.abs(position - i).max():.2e}")
    print(f"max |pattern - ALiBi(m={args.slope:g})| = {np.abs(pattern - alibi).max():.2e}")

    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), gridspec_kw=dict(width_ratios=[1.2, 1, 1]), layout="constrained")
    axes[0].plot(i, 1 / (i + 1), color="0.5", linestyle="--", label="1/(i+1)")
    axes[0].scatter(i, counter, s=14, color="#4477AA", label="counter dim after block 0", zorder=3)
    axes[0].set(
        xlabel="position i", ylabel="counter dimension (residual units)", title="Theorem 1: the causal mask counts"
    )
    axes[0].legend()
    for ax, matrix, title in (
        (axes[1], pattern, "block 1's head\n(no position embedding)"),
        (axes[2], alibi, f"ALiBi head, slope m = {args.slope:g}"),
    ):
        # imshow, not a heatmap of n_ctx^2 rectangles: one small image in the SVG
        image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.grid(False)
        ax.set(xlabel="key position j", title=title)
    axes[1].set_ylabel("query position i")
    fig.colorbar(image, ax=axes[1:], label="attention weight", shrink=0.9)
    fig.suptitle("A NoPE circuit (Kazemnejad et al. 2023, App. C): block 1 attends like ALiBi")
    paths = save_figure(fig, args.out / "circuit_demo") + [write_csv_atomic(table, args.out / "circuit_demo.csv")]
    print("wrote " + ", ".join(str(path) for path in paths))
    return paths


if __name__ == "__main__":
    sys.exit(guarded(main, "circuit_demo.py"))
