"""Kazemnejad et al. 2023 side by side: the paper's released numbers, its tasks and position-method
choices, and the verdict per claim of a ``nopelens lengthgen`` run.

"The Impact of Positional Encoding on Length Generalization in Transformers" (NeurIPS 2023) trains
decoder-only T5-base models (~107M parameters) on problem sizes 1-20 and tests exact match on the
unseen sizes 21-40. Its tasks (``scripts/dataset_builders/make_copy_dataset.py`` and
``make_reverse_dataset.py`` of McGill-NLP/length-generalization) and their nopelens homes
(:mod:`nopelens.models.tasks`):

=========  ================  ====================================================================
paper      nopelens task     layout (the paper's prompt words become one token each)
=========  ================  ====================================================================
``rsc``    ``repeat``        ``Copy: x x .. x [SEP] x x .. x``, one token n times
``rsc2x``  ``repeat_twice``  ``Copy: x .. x [SEP] x .. x``, n times then 2n times
``rdc``    ``replace``       ``Replace a with b in a .. a [SEP] b .. b``
``cmc``    ``copy``          ``Copy: x_1 .. x_n [SEP] x_1 .. x_n``, tokens drawn from 100
``mc``     ``reverse``       ``Reverse: x_1 .. x_n [SEP] x_n .. x_1``, tokens drawn from 100
=========  ================  ====================================================================

Their model is HF's T5 decoder, whose scores are unscaled q.k (no 1/sqrt(d_head)); its T5 bias is
one table in block 0 shared by every layer; its rotary rotates 25 % of each head in interleaved
pairs. :data:`VARIANTS` holds those choices as options of the method units, and the rows of
nopelens' own defaults where they differ (scaled scores, one T5 table per layer, full RoPE in
halves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats

PAPER_TASKS = {"repeat": "rsc", "repeat_twice": "rsc2x", "replace": "rdc", "copy": "cmc", "reverse": "mc"}
"""nopelens task -> the paper's dataset split prefix."""

RELEASED_SEEDS = (146317, 234054, 256788)
"""The paper's three training seeds (``cfg__trainer.seed``)."""

RELEASED_SOURCE = (
    "Kazemnejad et al. 2023, released results: McGill-NLP/length-generalization@d06170e, "
    "results/sanity_check.jsonl, runs of job_type best_run_seed_exp, sum__pred/test_acc_overall "
    "(the unweighted mean of the per-size accuracies test_acc_21 .. test_acc_40), seeds 146317, 234054, 256788"
)
"""Where every value of :data:`RELEASED_PER_SEED` comes from."""

RELEASED_PER_SEED = {
    ("rsc", "NoPE"): (0.9835, 0.9808, 0.9925),
    ("rsc", "T5 bias"): (0.7423, 0.8321, 0.7393),
    ("rsc", "ALiBi"): (0.279, 0.2655, 0.3234),
    ("rsc", "Rotary"): (0.0006, 0.0, 0.0),
    ("rsc", "APE"): (0.0, 0.0, 0.0),
    ("rsc2x", "NoPE"): (0.9731, 0.9844, 0.9633),
    ("rsc2x", "T5 bias"): (0.7346, 0.4068, 0.5316),
    ("rsc2x", "ALiBi"): (0.1676, 0.2733, 0.14),
    ("rsc2x", "Rotary"): (0.0, 0.0, 0.0),
    ("rsc2x", "APE"): (0.0, 0.0, 0.0),
    ("rdc", "NoPE"): (0.9895, 0.9474, 0.9647),
    ("rdc", "T5 bias"): (0.9692, 0.9268, 0.9211),
    ("rdc", "ALiBi"): (0.1922, 0.1326, 0.1844),
    ("rdc", "Rotary"): (0.0001, 0.0002, 0.0467),
    ("rdc", "APE"): (0.0, 0.0, 0.0),
    ("cmc", "NoPE"): (0.2896, 0.2944, 0.3322),
    ("cmc", "T5 bias"): (0.4154, 0.4082, 0.435),
    ("cmc", "ALiBi"): (0.3192, 0.344, 0.3299),
    ("cmc", "Rotary"): (0.0032, 0.0133, 0.0177),
    ("cmc", "APE"): (0.0227, 0.0322, 0.0283),
    ("mc", "NoPE"): (0.236, 0.2355, 0.2187),
    ("mc", "T5 bias"): (0.2298, 0.2686, 0.2284),
    ("mc", "ALiBi"): (0.1654, 0.1632, 0.184),
    ("mc", "Rotary"): (0.0406, 0.1635, 0.028),
    ("mc", "APE"): (0.018, 0.0148, 0.0363),
}
"""(paper task, paper method) -> the released score on sizes 21-40 per seed, in the order of
:data:`RELEASED_SEEDS` (source: :data:`RELEASED_SOURCE`). The score is the paper's per-size exact
match averaged over the sizes with equal weight, as nopelens averages its own; the file's
``test_seq_acc`` (pooled over test samples, which are not spread evenly over the sizes) is not used."""

RELEASED = {key: sum(values) / len(values) for key, values in RELEASED_PER_SEED.items()}
"""(paper task, paper method) -> the released mean over the three seeds."""


@dataclass(frozen=True)
class Variant:
    """A position method with the options one row of the comparison uses.

    Attributes:
        position: the ``DecoderConfig.position`` name.
        options: further ``DecoderConfig`` fields.
        paper_method: the paper's name of the method when the row uses the paper's choices, None
            for a row of nopelens' own defaults.
        note: what the row is, for the summary.
    """

    position: str
    options: dict = field(default_factory=dict)
    paper_method: str | None = None
    note: str = ""


UNSCALED = {"score_scale": 1.0}
VARIANTS = {
    "nope": Variant("nope", UNSCALED, "NoPE", "NoPE, unscaled q.k (the paper's T5 convention)"),
    "t5": Variant("t5", {**UNSCALED, "t5_shared": True}, "T5 bias", "T5 bias, one table shared by all layers"),
    "alibi": Variant("alibi", UNSCALED, "ALiBi", "ALiBi"),
    "rope": Variant(
        "rope",
        {**UNSCALED, "rotary_fraction": 0.25, "pairing": "interleaved"},
        "Rotary",
        "RoPE on 25 % of each head, interleaved pairs",
    ),
    "sinusoidal": Variant("sinusoidal", UNSCALED, "APE", "absolute sinusoidal"),
    "nope_scaled": Variant("nope", note="nopelens default: NoPE with q.k / sqrt(d_head)"),
    "t5_per_layer": Variant("t5", note="nopelens default: one T5 table per layer, q.k / sqrt(d_head)"),
    "rope_full": Variant("rope", note="nopelens default: RoPE on the whole head in halves, q.k / sqrt(d_head)"),
    "learned": Variant("learned", UNSCALED, None, "learned absolute (not in the released table)"),
}
"""Row name -> the method and options it trains with. The first five are the paper's choices."""

PAPER_VARIANTS = tuple(name for name, v in VARIANTS.items() if v.paper_method)
DEFAULT_ROWS = ("nope_scaled", "t5_per_layer", "rope_full")
SECOND_SEED = "nope (second seed)"
"""The attention-distance row of NoPE's second seed (the paper compares NoPE with itself too)."""


def released(task: str, variant: str) -> float:
    """The released number of a (nopelens task, row), NaN where the paper has none (or the row is
    not the paper's choice)."""
    method = VARIANTS[variant].paper_method
    return RELEASED.get((PAPER_TASKS.get(task), method), math.nan)


def released_per_seed(task: str, variant: str) -> tuple[float, ...]:
    """The released per-seed values of a (nopelens task, row); empty where the paper has none."""
    return RELEASED_PER_SEED.get((PAPER_TASKS.get(task), VARIANTS[variant].paper_method), ())


def mean_ci(values) -> tuple[float, float, float]:
    """Mean and 95 % t-interval over seeds (Student t, n - 1 degrees of freedom); NaN bounds for one seed."""
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return mean, mean - half, mean + half


def difference_ci(a, b) -> tuple[float, float, float]:
    """Mean of ``a`` minus mean of ``b`` with a 95 % Welch interval (independent seeds)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return diff, diff, diff
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.975, dof) * math.sqrt(va + vb))
    return diff, diff - half, diff + half


def per_seed_scores(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, method, seed): mean exact match and token accuracy over the unseen sizes
    (``longer``) and over the training sizes (``in_distribution``)."""
    frame = results.assign(split=np.where(results["in_distribution"].astype(bool), "in_distribution", "longer"))
    columns = ["exact_match"] + (["token_accuracy"] if "token_accuracy" in frame else [])
    table = frame.pivot_table(index=["task", "method", "seed"], columns="split", values=columns, aggfunc="mean")
    table.columns = [f"{metric}_{split}" for metric, split in table.columns]
    return table.reset_index()


def side_by_side(results: pd.DataFrame, n_symbols: int) -> pd.DataFrame:
    """Per (task, method): seeds, per-seed values, mean and 95 % CI of the exact match on the
    unseen sizes (the paper's metric), our token accuracy there with its no-information floor,
    the in-distribution exact match, and the released number with its source."""
    rows = []
    for (task, method), group in per_seed_scores(results).groupby(["task", "method"], sort=False):
        group = group.sort_values("seed")
        mean, low, high = mean_ci(group["exact_match_longer"])
        value = released(task, method)
        rows.append(
            dict(
                task=task,
                paper_task=PAPER_TASKS.get(task, ""),
                method=method,
                paper_method=VARIANTS[method].paper_method or "",
                seeds=len(group),
                per_seed=" ".join(f"{v:.3f}" for v in group["exact_match_longer"]),
                exact_match_longer=mean,
                ci_low=low,
                ci_high=high,
                exact_match_floor=0.0,
                token_accuracy_longer=float(group.get("token_accuracy_longer", pd.Series([math.nan])).mean()),
                token_accuracy_floor=1.0 / n_symbols,
                exact_match_in_distribution=float(group["exact_match_in_distribution"].mean()),
                released=value,
                released_per_seed=" ".join(f"{v:.4f}" for v in released_per_seed(task, method)),
                released_in_ci=bool(low <= value <= high) if not math.isnan(value) else None,
                released_source=RELEASED_SOURCE if not math.isnan(value) else "",
            )
        )
    order = {name: i for i, name in enumerate(VARIANTS)}
    table = pd.DataFrame(rows)
    return table.sort_values(
        ["task", "method"], key=lambda s: s.map(order) if s.name == "method" else s, kind="stable"
    ).reset_index(drop=True)


TIE = 0.05
"""Released differences smaller than this (exact-match points) are not read as a claim."""
LEARNED = 0.5
"""In-distribution exact match (sizes 1..L) a model needs before its score on longer sizes says
anything about length generalization."""


def ranking_verdicts(results: pd.DataFrame) -> pd.DataFrame:
    """One verdict per claim "NoPE beats (or trails) method X on task T", from the released means.

    A claim exists where the released NoPE and X differ by more than :data:`TIE`. With our
    difference d (NoPE minus X, mean over seeds) and its 95 % Welch CI: *reproduced* when the CI
    excludes 0 on the paper's side and holds the released difference; *direction only* when it
    excludes 0 on the paper's side but not the released size; *not reproduced* otherwise (the CI
    holds 0, or excludes it on the other side), and whenever either model's in-distribution exact
    match is below :data:`LEARNED` (then the claim was not tested).
    """
    scores = per_seed_scores(results)
    rows = []
    for task, group in scores.groupby("task", sort=False):
        rows_of = {name: group[group["method"] == name] for name in PAPER_VARIANTS}
        nope = rows_of[PAPER_VARIANTS[0]]
        for other in PAPER_VARIANTS[1:]:
            theirs = rows_of[other]
            paper = released(task, PAPER_VARIANTS[0]) - released(task, other)
            if nope.empty or theirs.empty or math.isnan(paper) or abs(paper) <= TIE:
                continue
            diff, low, high = difference_ci(nope["exact_match_longer"], theirs["exact_match_longer"])
            learned = {
                VARIANTS[name].paper_method: rows["exact_match_in_distribution"].mean()
                for name, rows in ((PAPER_VARIANTS[0], nope), (other, theirs))
            }
            verdict = _verdict(paper, diff, low, high)
            if min(learned.values()) < LEARNED:
                verdict = dict(
                    verdict="not reproduced",
                    why="not learned in distribution (exact match on 1-L: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in learned.items())
                    + f", below {LEARNED}): no test",
                )
            rows.append(
                dict(
                    task=task,
                    paper_task=PAPER_TASKS[task],
                    claim=f"NoPE {'above' if paper > 0 else 'below'} {VARIANTS[other].paper_method}",
                    released_difference=paper,
                    difference=diff,
                    ci_low=low,
                    ci_high=high,
                    **verdict,
                )
            )
    return pd.DataFrame(
        rows,
        columns=[
            "task",
            "paper_task",
            "claim",
            "released_difference",
            "difference",
            "ci_low",
            "ci_high",
            "verdict",
            "why",
        ],
    )


def _verdict(paper: float, diff: float, low: float, high: float) -> dict:
    if math.isnan(low):
        return dict(verdict="not reproduced", why="one seed per method: no interval")
    side = low > 0 if paper > 0 else high < 0
    if side and low <= paper <= high:
        return dict(verdict="reproduced", why="same side, CI holds the released difference")
    if side:
        return dict(verdict="direction only", why=f"same side, but the released {paper:+.3f} is outside the CI")
    if high < 0 if paper > 0 else low > 0:
        return dict(verdict="not reproduced", why="the CI excludes 0 on the other side")
    return dict(verdict="not reproduced", why="the CI holds 0: no difference shown")


def distance_verdicts(
    distances: pd.DataFrame, nope: str = "nope", second: str = "nope (second seed)", unlearned: frozenset = frozenset()
) -> pd.DataFrame:
    """The paper's Sec. 5.2 claims per task, on the layer-mean distances from ``nope``: NoPE is
    closest to T5 bias among the explicit methods; NoPE is closer to another NoPE seed than to
    Rotary and APE; NoPE is farthest from Rotary and APE. One model pair per cell, so each claim
    is reproduced or not, without a CI."""
    row_of = {VARIANTS[name].paper_method: name for name in PAPER_VARIANTS}
    near, far_names = row_of["T5 bias"], {row_of["Rotary"], row_of["APE"]}
    rows = []
    for task, group in distances.groupby("task", sort=False):
        mean = group[group["model_a"] == nope].groupby("model_b")["jsd_bits"].mean()
        explicit = [name for name in PAPER_VARIANTS[1:] if name in mean]
        if len(explicit) < 2:
            continue
        order = mean[explicit].sort_values()
        far = far_names & set(explicit)
        checks = [("NoPE closest to T5 bias", order.index[0] == near, f"closest: {order.index[0]}")]
        if far:
            checks.append(
                (
                    "NoPE farthest from Rotary and APE",
                    set(order.index[-len(far) :]) == far,
                    f"farthest: {', '.join(order.index[-len(far) :])}",
                )
            )
        if second in mean and far:
            checks.append(
                (
                    "NoPE closer to another NoPE seed than to Rotary and APE",
                    bool(mean[second] < min(mean[name] for name in far)),
                    f"second seed {mean[second]:.3f} bits, Rotary/APE from {min(mean[n] for n in far):.3f}",
                )
            )
        for claim, holds, why in checks:
            if task in unlearned:
                holds, why = False, f"not learned in distribution (NoPE below {LEARNED}): no test; {why}"
            rows.append(
                dict(
                    task=task,
                    claim=claim,
                    verdict="reproduced" if holds else "not reproduced",
                    why=why + " (mean over layers, one model per method)",
                )
            )
    return pd.DataFrame(rows, columns=["task", "claim", "verdict", "why"])
