"""A hand-built NoPE circuit (Kazemnejad et al. 2023, App. C) read through TransformerLens hooks.

Block 0 is Theorem 1's counter: a uniform causal head reading a BOS-only value writes 1/(i+1)
at position i, and its MLP turns that into i. Block 1 is Theorem 2's distance head: from i in the
residual stream it scores -m (i - j), so its pattern is the pattern of an ALiBi head of slope m,
although the model has no position embedding at all.

    python examples/circuit_demo.py --n-ctx 64 --slope 0.5

Writes ``circuit_demo.png``/``.svg`` (the counter next to 1/(i+1); the head's pattern next to the
ALiBi pattern) and ``circuit_demo.csv`` (the counter per position) into --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from nopelens import circuits
from nopelens.analyses.report import save_figure
from nopelens.models.io import write_csv_atomic


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-ctx", type=int, default=64, help="positions (BOS at 0)")
    parser.add_argument("--slope", type=float, default=0.5, help="the ALiBi slope m the distance head reproduces")
    parser.add_argument("--out", type=Path, default=Path("runs/examples"))
    args = parser.parse_args(argv)

    model = circuits.distance(args.n_ctx, slope=args.slope)
    tokens = circuits.circuit_tokens(model, seed=0)  # BOS, then random tokens
    _, cache = model.run_with_cache(tokens)

    i = np.arange(args.n_ctx)
    counter = cache["blocks.0.hook_resid_post"][0, :, model.circuit.counter_dim].numpy()
    position = cache["blocks.0.hook_resid_post"][0, :, model.circuit.position_dim].numpy()
    uniform = cache["blocks.0.attn.hook_pattern"][0, 0].numpy()  # the counter head: 1/(i+1) on each visible key
    pattern = cache["blocks.1.attn.hook_pattern"][0, 0].numpy()
    alibi = circuits.alibi_reference_pattern(args.n_ctx, args.slope).numpy()
    table = pd.DataFrame({"position": i, "counter": counter, "one_over_i_plus_1": 1 / (i + 1),
                          "bos_weight": uniform[:, 0], "position_dim": position})
    print(f"max |counter - 1/(i+1)| = {np.abs(counter - 1 / (i + 1)).max():.2e}")
    print(f"max |position dim - i|   = {np.abs(position - i).max():.2e}")
    print(f"max |pattern - ALiBi(m={args.slope:g})| = {np.abs(pattern - alibi).max():.2e}")

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    sns.lineplot(x=i, y=1 / (i + 1), ax=axes[0], color="0.6", linestyle="--", label="1/(i+1)")
    sns.scatterplot(x=i, y=counter, ax=axes[0], s=16, label="counter dim after block 0")
    axes[0].set(xlabel="position i", ylabel="value", title="Theorem 1: the causal mask counts")
    for ax, matrix, title in ((axes[1], pattern, "block 1's head (no position embedding)"),
                              (axes[2], alibi, f"ALiBi head, slope m = {args.slope:g}")):
        sns.heatmap(matrix, ax=ax, cmap="viridis", square=True, xticklabels=False, yticklabels=False)
        ax.set(xlabel="key position j", ylabel="query position i", title=title)
    return save_figure(fig, args.out / "circuit_demo") + [write_csv_atomic(table, args.out / "circuit_demo.csv")]


if __name__ == "__main__":
    main()
