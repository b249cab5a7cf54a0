"""Haviv et al. 2022's numbers, as facts with their source: the one table of the paper's values that
``nopelens compare haviv`` (:mod:`nopelens.analyses.haviv`) sets ours beside.

Haviv, Ram, Press, Izsak & Levy, "Transformer Language Models without Positional Encodings Still
Learn Positional Information", Findings of EMNLP 2022 (arXiv 2203.16634). Every value below is
copied from a file of the authors' released repository, ``github.com/adihaviv/NoPos`` at commit
23ef40df427aabff71ee537d245229ec72298333, folder ``nopos_experiments/plots_creation/data_plots/``,
the data their ``plotter.py`` draws the paper's figures from:

- ``probe.csv``: the mean absolute distance (MAD, in tokens) of the 2-layer ReLU MLP position
  probe at the embeddings (layer 0) and after each of the 24 layers of the 1.3B-parameter models
  trained on The Pile at 1,024 tokens (§4's probing figure), for NoPE (column ``None``), learned,
  sinusoidal and ALiBi, with its chance column ``Random`` = 341.3333 = 1024 / 3, the MAD of uniform
  random guesses in the continuous approximation (the exact discrete value, (1024^2 - 1) / (3 x 1024)
  = 341.3330, which nopelens uses, differs by 1e-6 relative). MAD/chance is the value over that chance.
- ``main_wiki_pile.csv``: validation perplexity by method on WikiText-103 and The Pile (the
  paper's Table 1 values).

Not found in the released files (so not in this table, and said so in the docs): RoPE (the paper
did not train it), and the perplexities by model size behind the "gap narrows with scale" claim
(the paper's scale table: 125M to 1.3B parameters); that claim is quoted as the paper states it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

REPOSITORY = "adihaviv/NoPos@23ef40d"
PROBE_FILE = f"{REPOSITORY}:nopos_experiments/plots_creation/data_plots/probe.csv"
PERPLEXITY_FILE = f"{REPOSITORY}:nopos_experiments/plots_creation/data_plots/main_wiki_pile.csv"
PAPER_LAYERS = 24
"""Blocks of the probed 1.3B models (probe.csv has layers 0..24)."""
PAPER_POSITIONS = 1024
PAPER_CHANCE_MAD = 341.3333
"""probe.csv's ``Random`` column, the same at every layer: 1024 / 3."""

PAPER_MAD = {
    "nope": (
        337.162,
        286.432,
        79.889,
        27.508,
        16.932,
        17.392,
        16.46,
        16.528,
        17.222,
        19.175,
        19.922,
        20.963,
        20.974,
        22.285,
        23.916,
        25.628,
        27.35,
        27.92,
        31.034,
        35.419,
        42.563,
        49.242,
        56.445,
        64.132,
        133.303,
    ),
    "learned": (
        11.24,
        6.451,
        7.643,
        8.369,
        6.953,
        7.082,
        8.817,
        10.148,
        12.036,
        13.756,
        14.729,
        16.309,
        18.051,
        19.819,
        21.167,
        22.124,
        23.494,
        25.595,
        28.878,
        33.772,
        40.353,
        47.045,
        53.578,
        62.477,
        128.985,
    ),
    "sinusoidal": (
        0.008,
        0.009,
        0.022,
        0.109,
        0.253,
        0.343,
        0.402,
        0.499,
        0.586,
        0.756,
        0.997,
        1.3,
        1.865,
        2.636,
        4.021,
        5.896,
        8.293,
        11.638,
        15.989,
        21.544,
        27.485,
        34.823,
        41.923,
        51.323,
        92.1,
    ),
    "alibi": (
        337.005,
        331.348,
        288.312,
        251.99,
        183.511,
        121.286,
        72.825,
        59.335,
        54.767,
        53.894,
        53.987,
        52.66,
        52.959,
        53.989,
        55.937,
        59.724,
        66.659,
        72.555,
        79.589,
        87.239,
        98.969,
        108.404,
        117.68,
        132.169,
        170.566,
    ),
}
"""Method -> MAD in tokens at layers 0..24 (probe.csv columns None, Learned, Sinusoidal, ALiBi)."""

BASELINE = "learned"
"""The method the paper measures the others against (its learned absolute positions, Table 1)."""

PAPER_PERPLEXITY = {
    ("wikitext-103", "nope"): 20.97,
    ("wikitext-103", "learned"): 20.42,
    ("wikitext-103", "sinusoidal"): 20.16,
    ("wikitext-103", "alibi"): 19.71,
    ("the_pile", "nope"): 13.1,
    ("the_pile", "learned"): 13.05,
    ("the_pile", "sinusoidal"): 12.93,
    ("the_pile", "alibi"): 12.51,
}
"""(dataset, method) -> validation perplexity (main_wiki_pile.csv; the paper's Table 1)."""

PAPER_SCALE_CLAIM = (
    "NoPos models are competitive with position-aware models across model sizes; the gap to "
    "them narrows as the model grows (paper §3, model-size comparison, 125M to 1.3B parameters; "
    "the per-size numbers are not in the released files and are not copied here)"
)


def paper_table() -> pd.DataFrame:
    """The paper's values, one row per (quantity, method, layer or dataset), each with its source.

    Columns: ``quantity`` (``mad``, ``mad_chance``, ``perplexity``), ``method`` (nopelens' method
    names: ``nope`` for the paper's NoPos), ``layer`` (probe rows; NaN otherwise), ``n_layers``,
    ``depth`` (layer / n_layers), ``dataset``, ``n_positions``, ``value``, ``source``.
    """
    rows = []
    for method, values in PAPER_MAD.items():
        for layer, mad in enumerate(values):
            common = dict(
                method=method,
                layer=layer,
                n_layers=PAPER_LAYERS,
                depth=layer / PAPER_LAYERS,
                dataset="the_pile",
                n_positions=PAPER_POSITIONS,
                source=PROBE_FILE,
            )
            rows.append(dict(quantity="mad", value=mad, **common))
            rows.append(dict(quantity="mad_chance", value=mad / PAPER_CHANCE_MAD, **common))
    for (dataset, method), value in PAPER_PERPLEXITY.items():
        rows.append(
            dict(
                quantity="perplexity",
                method=method,
                layer=np.nan,
                n_layers=PAPER_LAYERS,
                depth=np.nan,
                dataset=dataset,
                n_positions=PAPER_POSITIONS,
                value=value,
                source=PERPLEXITY_FILE,
            )
        )
    return pd.DataFrame(rows)


def paper_curve(method: str) -> pd.DataFrame | None:
    """The paper's MAD/chance per layer of ``method`` (columns ``layer``, ``depth``, ``mad_chance``),
    or None where the paper has no such model (RoPE)."""
    if method not in PAPER_MAD:
        return None
    table = paper_table()
    rows = table[(table["quantity"] == "mad_chance") & (table["method"] == method)]
    return rows[["layer", "depth", "value"]].rename(columns={"value": "mad_chance"}).reset_index(drop=True)
