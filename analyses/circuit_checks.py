"""The hand-built circuits and seed demonstrations behind ``nopelens circuit``: each subject
builds its model or demo, checks it against its exact answer, and draws its figure.

Subjects (:data:`RUNNERS`):

- ``counter``: Theorem 1 (Kazemnejad et al. 2023, App. C); counter and position dims vs position.
- ``distance``: Theorem 2; the layer-2 pattern next to the Decoder's own ALiBi head of slope m.
- ``previous-token``: the -c (i - j - 1)^2 head; its pattern and its mass on j = i - 1.
- ``equivariance``: seed 001, Attention(PX) = P Attention(X) with and without a causal mask.
- ``mask-table``: seed 000, the FIG-004 causal table, the fully-masked rejection, blocking vs a zero score.

Each runner returns its checks (one row per check: value, bound, passed; ``passed`` is None for
an informational row) and its figure, and says what it built through ``say``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from nopelens import circuits  # noqa: E402
from nopelens.circuits import demos  # noqa: E402

from .figures import TOL_BRIGHT  # noqa: E402

SUBJECTS = ("counter", "distance", "previous-token", "equivariance", "mask-table")


@dataclass(frozen=True)
class CircuitSettings:
    """What a circuit subject is built with.

    Attributes:
        n_ctx: positions the circuit covers (>= 2).
        slope: ALiBi slope m of the distance head.
        sharpness: c of the previous-token head.
        construction: the counter MLP (:data:`nopelens.circuits.counter.CONSTRUCTIONS`).
        d_vocab: vocabulary size, BOS included.
        seed: seed of the random tokens and demo inputs.
    """

    n_ctx: int = 64
    slope: float = 0.5
    sharpness: float = 10.0
    construction: str = "steps"
    d_vocab: int = 8
    seed: int = 0


# (check name, bound, "max" if the value must stay <= bound, "min" if it must exceed it)
COUNTER_BOUNDS = {
    "counter_max_error": (1e-6, "max"),
    "position_max_error": (1e-4, "max"),
    "no_bos_counter_max_abs": (0.0, "max"),
    "constant_input_max_pattern_deviation": (1e-6, "max"),
}
DISTANCE_BOUNDS = {"pattern_max_error": (1e-5, "max")}
PREVIOUS_BOUNDS = {"min_previous_mass": (0.99, "min"), "row0_self_mass": (1.0 - 1e-6, "min")}


def _passes(value: float, bound: float, kind: str) -> bool:
    return value <= bound if kind == "max" else value > bound


def _checks_table(subject: str, values: dict, bounds: dict) -> pd.DataFrame:
    rows = []
    for name, value in values.items():
        bound, kind = bounds.get(name, (None, None))
        passed = None if bound is None else _passes(float(value), bound, kind)
        rows.append({"subject": subject, "check": name, "value": value, "bound": bound, "kind": kind, "passed": passed})
    return pd.DataFrame(rows)


def _style() -> None:
    """The figures' look: seaborn's white grid with Tol's colour-blind-safe colours."""
    sns.set_theme(style="whitegrid", context="notebook", palette=list(TOL_BRIGHT))


def _pattern(ax: plt.Axes, matrix: np.ndarray, title: str, vmax: float = 1.0, label: str = "attention weight"):
    """An attention pattern [query, key] as one image (small in SVG, unlike a heatmap of n^2 cells)."""
    image = ax.imshow(matrix, cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
    ax.grid(False)
    ax.set(xlabel="key position j", ylabel="query position i", title=title)
    ax.figure.colorbar(image, ax=ax, label=label, shrink=0.85)


# ----------------------------------------------------------------------------- subjects
def run_counter(settings: CircuitSettings, say: Callable[[str], None] = print) -> tuple[pd.DataFrame, plt.Figure]:
    model = circuits.counter(settings.n_ctx, d_vocab=settings.d_vocab, construction=settings.construction)
    say(model.circuit.describe())
    values = circuits.check_counter(model, seed=settings.seed)
    control = demos.constant_input_control(model, token=1, length=settings.n_ctx)
    values.update({f"constant_input_{name}": value for name, value in control.items()})
    trace = circuits.counter_trace(model, circuits.circuit_tokens(model, seed=settings.seed))
    no_bos = circuits.counter_trace(model, circuits.circuit_tokens(model, seed=settings.seed, bos=False))

    _style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    sns.lineplot(x=trace.position, y=trace.expected_counter, ax=left, color="0.6", linestyle="--", label="1/(i+1)")
    sns.scatterplot(x=trace.position, y=trace.counter, ax=left, s=14, label="counter dim, BOS first")
    sns.scatterplot(x=no_bos.position, y=no_bos.counter, ax=left, s=14, marker="x", label="counter dim, no BOS")
    left.set(xlabel="position i", ylabel="counter dimension after layer 1", title="Theorem 1: the counter")
    sns.lineplot(x=trace.position, y=trace.position, ax=right, color="0.6", linestyle="--", label="i")
    sns.scatterplot(x=trace.position, y=trace.position_value, ax=right, s=14, label="position dim")
    right.set(
        xlabel="position i",
        ylabel="position dimension after layer 1",
        title=f"MLP inverse ({settings.construction}): max error {values['position_max_error']:.1e}",
    )
    return _checks_table("counter", values, COUNTER_BOUNDS), fig


def run_distance(settings: CircuitSettings, say: Callable[[str], None] = print) -> tuple[pd.DataFrame, plt.Figure]:
    model = circuits.distance(
        settings.n_ctx, slope=settings.slope, d_vocab=settings.d_vocab, construction=settings.construction
    )
    say(model.circuit.describe())
    values = circuits.check_distance(model, seed=settings.seed)
    pattern = circuits.head_pattern(model, circuits.circuit_tokens(model, seed=settings.seed)).numpy()
    reference = circuits.alibi_reference_pattern(settings.n_ctx, settings.slope).numpy()
    _style()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout="constrained")
    _pattern(axes[0], pattern, "circuit: block 1's head\n(no position embedding)")
    _pattern(
        axes[1],
        reference,
        f"Decoder's ALiBi head {values['alibi_head']} of {values['alibi_heads']}\n(slope m = {settings.slope:g})",
    )
    difference = np.abs(pattern - reference)
    _pattern(
        axes[2],
        difference,
        f"|difference|: max {values['pattern_max_error']:.1e}",
        vmax=max(float(difference.max()), 1e-6),
        label="|difference| (attention weight)",
    )
    fig.suptitle("Theorem 2: a NoPE head that scores -m (i - j) from the counted position attends like ALiBi")
    return _checks_table("distance", values, DISTANCE_BOUNDS), fig


def run_previous_token(
    settings: CircuitSettings, say: Callable[[str], None] = print
) -> tuple[pd.DataFrame, plt.Figure]:
    model = circuits.previous_token(
        settings.n_ctx, sharpness=settings.sharpness, d_vocab=settings.d_vocab, construction=settings.construction
    )
    say(model.circuit.describe())
    values = circuits.check_previous_token(model, seed=settings.seed)
    tokens = circuits.circuit_tokens(model, seed=settings.seed)
    pattern = circuits.head_pattern(model, tokens).numpy()
    mass = circuits.previous_token_mass(model, tokens)
    _style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    _pattern(left, pattern, f"previous-token head (c = {settings.sharpness:g})")
    sns.lineplot(x=mass.position[1:], y=mass.previous_mass[1:], ax=right, marker="o", markersize=3)
    right.axhline(0.99, color="0.6", linestyle="--", label="check bound 0.99")
    right.set(xlabel="query position i", ylabel="attention weight on key j = i - 1", title="mass on the previous token")
    right.legend(loc="lower right")
    return _checks_table("previous_token", values, PREVIOUS_BOUNDS), fig


def run_equivariance(settings: CircuitSettings, say: Callable[[str], None] = print) -> tuple[pd.DataFrame, plt.Figure]:
    result = demos.permutation_equivariance(seed=settings.seed)
    expected = {
        "all_visible": True,
        "fixed_causal_mask": False,
        "permuted_causal_mask": True,
        "nope_decoder_causal": False,
    }
    say("seed 001: Attention(PX) == P Attention(X)?  (P reorders rows [0, 1, 2] to [2, 0, 1])")
    rows = []
    for name, want in expected.items():
        got, error = result[name], result[f"{name}_max_error"]
        say(f"  {name:<24} {str(got):<5} (max |A(PX) - P A(X)| = {error:.2e}; expected {want})")
        rows.append(
            {
                "subject": "equivariance",
                "check": name,
                "value": got,
                "max_error": error,
                "expected": want,
                "passed": got == want,
            }
        )
    table = pd.DataFrame(rows)
    _style()
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    plot = table.assign(
        max_error=table.max_error.clip(lower=1e-17),  # log axis: 0 -> 1e-17
        equivariant=table.value.map({True: "yes", False: "no"}),
        check=table.check.str.replace("_", " "),
    )
    sns.barplot(data=plot, x="check", y="max_error", hue="equivariant", hue_order=["yes", "no"], ax=ax, dodge=False)
    ax.set(
        yscale="log",
        xlabel="",
        ylabel="max |Attention(PX) − P Attention(X)|",
        title="seed 001: permutation equivariance (exact values, no sampling)",
    )
    ax.tick_params(axis="x", rotation=15)
    return table, fig


def run_mask_table(settings: CircuitSettings, say: Callable[[str], None] = print) -> tuple[pd.DataFrame, plt.Figure]:
    table = demos.causal_table()
    say("seed 000, FIG-004: causal visibility (rows: queries, columns: keys)")
    say(table.to_string())
    empty_rows = demos.rows_with_no_allowed_key(table)
    say(f"  rows with no allowed key: {empty_rows or 'none'}")
    message = demos.fully_masked_rejection()
    say(f"  fully masked input -> ValueError: {message}")
    weights = demos.blocking_vs_zero_score()
    say("seed 000: blocking is not scoring zero (query 'rises', key 'rises' blocked or scored 0)")
    say(weights.round(6).to_string())
    allowed = weights.index != weights.index[-1]
    checks = pd.DataFrame(
        [
            {
                "subject": "mask_table",
                "check": "rows_with_no_allowed_key",
                "value": len(empty_rows),
                "passed": not empty_rows,
            },
            {"subject": "mask_table", "check": "fully_masked_rejected", "value": message, "passed": True},
            {
                "subject": "mask_table",
                "check": "blocked_weight",
                "value": float(weights.blocked.iloc[-1]),
                "passed": weights.blocked.iloc[-1] == 0.0,
            },
            {
                "subject": "mask_table",
                "check": "zero_score_weight",
                "value": float(weights.zero_score.iloc[-1]),
                "passed": weights.zero_score.iloc[-1] > 0.0,
            },
            {
                "subject": "mask_table",
                "check": "renormalized_max_error",
                "value": float((weights.blocked - weights.renormalized)[allowed].abs().max()),
                "passed": bool(np.allclose(weights.blocked, weights.renormalized, atol=1e-12)),
            },
        ]
    )
    _style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    sns.heatmap((table == "Allowed").astype(int), annot=table.to_numpy(), fmt="", cbar=False, cmap="Greens", ax=left)
    left.set(title="FIG-004: key j visible to query i iff j <= i")
    long = (
        weights[["unmasked", "zero_score", "blocked"]]
        .rename(columns={"zero_score": "zero score"})
        .reset_index()
        .melt(id_vars="key", var_name="key 'rises'", value_name="weight")
    )
    sns.barplot(data=long, x="key", y="weight", hue="key 'rises'", ax=right)
    right.set(
        title="blocking (-inf) is not scoring zero\n(exact softmax weights, no sampling)", ylabel="attention weight"
    )
    return checks, fig


RUNNERS = {
    "counter": run_counter,
    "distance": run_distance,
    "previous-token": run_previous_token,
    "equivariance": run_equivariance,
    "mask-table": run_mask_table,
}
