"""Extreme-token phenomena: active-dormant heads, value-state drains and residual-state peaks.

Guo et al. 2024 ("Active-dormant attention heads: mechanistically demystifying extreme-token
phenomena in LLMs", §2) train small transformers on the Bigram-Backcopy task
(:class:`~nopelens.models.tasks.BigramBackcopyTask`) and find three phenomena on the first token:

- **active-dormant heads**: a head that attends to the previous token on trigger queries (active),
  where the task needs it, and puts its attention on the first token elsewhere (dormant: an
  attention sink);
- **value-state drain**: the first token's value state is much smaller than the others', so the
  dormant head writes almost nothing;
- **residual-state peak**: the first token's residual-stream norm is much larger than the others'.

This module measures each from collected activations (:func:`~nopelens.probes.collect`): the
attention a head puts on key 0 and on the previous key, split by query class (trigger or not);
value norms per head at ``hook_v``; residual norms per layer. Queries at positions >= 2 are
counted, where key 0 and the previous key differ. Sequences are the bootstrap unit of the 95 % CIs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from .collect import Activations, site_block, site_layer
from .metrics import random_state
from .sinks import GU_EPSILON

ACTIVE_THRESHOLD = 0.5
"""A head is *active* on a query class when more than half its attention goes to the previous token."""

FIRST_QUERY = 2
"""Queries before this position are left out: at position 1 the previous key is key 0."""


def ratio_ci(numerator: np.ndarray, denominator: np.ndarray, n_boot: int = 200,
             seed: int = 0) -> tuple[float, float, float]:
    """sum(numerator) / sum(denominator) with a paired percentile bootstrap 95 % CI over rows (SciPy).

    Rows are sequences: each holds one sequence's summed attention and its number of queries, so
    the ratio is the mean over all pooled queries and the CI resamples whole sequences.

    Raises:
        ValueError: if the denominators sum to 0 (no query of the class).

    Example:
        >>> ratio_ci(np.array([1.0, 3.0]), np.array([2.0, 2.0]), n_boot=0)
        (1.0, nan, nan)
    """
    numerator, denominator = np.asarray(numerator, float), np.asarray(denominator, float)
    if denominator.sum() == 0:
        raise ValueError("no query of this class: the mean is undefined")
    value = float(numerator.sum() / denominator.sum())
    used = denominator > 0
    if n_boot < 1 or used.sum() < 2:
        return value, float("nan"), float("nan")
    if np.ptp(numerator[used] / denominator[used]) == 0:
        return value, value, value
    result = stats.bootstrap((numerator, denominator), lambda a, b, axis=-1: a.sum(axis) / b.sum(axis),
                             paired=True, vectorized=True, n_resamples=n_boot, method="percentile",
                             random_state=random_state(seed))
    return value, float(result.confidence_interval.low), float(result.confidence_interval.high)


def active_dormant_table(acts: Activations, query_class: Sequence[np.ndarray],
                         classes: dict[str, bool] | None = None, n_boot: int = 200, seed: int = 0) -> pd.DataFrame:
    """Per head and query class: attention on the first token and on the previous token.

    Args:
        acts: activations holding ``blocks.{l}.attn.hook_pattern`` patterns (padding removed, so
            key 0 is the first real token).
        query_class: one bool array ``[n_real]`` per sequence; True marks a query of the first
            class (for the BB task: the query token is a trigger).
        classes: names of the two classes, ``{name: flag}``; default ``{"trigger": True,
            "non_trigger": False}``.
        n_boot, seed: bootstrap replicates and seed of the CIs.

    Returns:
        One row per (site, head, class): ``block``, ``head``, ``query_class``, ``n_queries``,
        ``first_mass`` (mean attention on key 0) and ``previous_mass`` (on key i - 1), each with
        ``_ci_low``/``_ci_high``; ``dormant`` (first_mass > Gu's 0.3) and ``active``
        (previous_mass > :data:`ACTIVE_THRESHOLD`).

    Raises:
        ValueError: if no pattern site was collected or ``query_class`` does not match the patterns.
    """
    classes = {"trigger": True, "non_trigger": False} if classes is None else classes
    sites = [site for site in acts.patterns if site.endswith("hook_pattern")]
    if not sites:
        raise ValueError("no hook_pattern site was collected")
    rows = []
    for site in sites:
        patterns = acts.patterns[site]
        if len(patterns) != len(query_class):
            raise ValueError(f"{len(query_class)} query-class arrays for {len(patterns)} sequences")
        n_heads = patterns[0].shape[0]
        for name, flag in classes.items():
            sums = np.zeros((len(patterns), n_heads, 2))
            counts = np.zeros(len(patterns))
            for k, (pattern, cls) in enumerate(zip(patterns, query_class)):
                n = pattern.shape[-1]
                if len(cls) != n:
                    raise ValueError(f"sequence {k}: {len(cls)} query flags for {n} real tokens")
                queries = np.flatnonzero((np.asarray(cls, bool) == flag) & (np.arange(n) >= FIRST_QUERY))
                counts[k] = len(queries)
                sums[k, :, 0] = pattern[:, queries, 0].sum(-1)
                sums[k, :, 1] = pattern[:, queries, queries - 1].sum(-1)
            if counts.sum() == 0:
                continue
            for head in range(n_heads):
                first = ratio_ci(sums[:, head, 0], counts, n_boot, seed)
                previous = ratio_ci(sums[:, head, 1], counts, n_boot, seed)
                rows.append(dict(site=site, block=site_block(site), head=head, query_class=name,
                                 n_queries=int(counts.sum()), first_mass=first[0], first_mass_ci_low=first[1],
                                 first_mass_ci_high=first[2], previous_mass=previous[0],
                                 previous_mass_ci_low=previous[1], previous_mass_ci_high=previous[2],
                                 dormant=bool(first[0] > GU_EPSILON), active=bool(previous[0] > ACTIVE_THRESHOLD)))
    return pd.DataFrame(rows)


def first_token_norms(acts: Activations, sites: Sequence[str]) -> pd.DataFrame:
    """L2 norm of the first real token's state against the other tokens', per site (and head).

    Residual sites (``[n, d_model]``) give one row; per-head sites such as ``hook_v``
    (``[n, head_index, d_head]``) one row per head.

    Returns:
        ``site``, ``layer`` (residual sites) or ``block``, ``head`` (-1 for residual sites),
        ``first_norm`` (mean over sequences of the norm at position 0), ``other_norm`` (mean over
        the tokens at positions >= 1), ``ratio`` = first / other (< 1 is a value-state drain at
        ``hook_v``, > 1 a residual-state peak) and ``note``: where the other tokens' states are all
        zero the ratio is NaN and the note says so.

    Raises:
        KeyError: for a site that was not collected. ValueError: if no token follows the first.
    """
    first = acts.position == 0
    if first.all():
        raise ValueError("every sequence has one token: no other token to compare the first with")
    rows = []
    for site in sites:
        if site not in acts.acts:
            raise KeyError(f"site {site!r} was not collected; collected: {sorted(acts.acts)}")
        array = acts.acts[site].astype(np.float64)
        norms = np.linalg.norm(array, axis=-1)  # [n] or [n, head]
        per_head = norms.reshape(len(norms), -1)
        layer = site_layer(site)
        for head in range(per_head.shape[1]):
            first_norm, other_norm = per_head[first, head].mean(), per_head[~first, head].mean()
            zero = other_norm == 0
            rows.append(dict(site=site, layer=layer, block=site_block(site),
                             head=head if norms.ndim > 1 else -1, first_norm=float(first_norm),
                             other_norm=float(other_norm), ratio=float("nan") if zero else float(first_norm / other_norm),
                             note="the other tokens' states are all zero: no ratio" if zero else ""))
    return pd.DataFrame(rows)
