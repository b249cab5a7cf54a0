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

This module measures each as statistics summed batch by batch while the model runs
(:class:`ActiveDormantStats`, :class:`FirstTokenNorms`, fed by :func:`~nopelens.probes.stream.run`)
or replayed on collected activations (:func:`active_dormant_table`, :func:`first_token_norms`: the
same measurements, :func:`~nopelens.probes.stream.replay`): the attention a head puts on key 0 and
on the previous key, split by query class (trigger or not); value norms per head at ``hook_v``;
residual norms per layer. Queries at positions >= 2 are counted, where key 0 and the previous key
differ. Sequences are the bootstrap unit of the 95 % CIs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch
from scipy import stats
from torch import Tensor

from .collect import Activations, site_block, site_layer
from .metrics import random_state
from .sinks import GU_EPSILON
from .stream import Batch, Measurement, Sequences, replay

ACTIVE_THRESHOLD = 0.5
"""A head is *active* on a query class when more than half its attention goes to the previous token."""

FIRST_QUERY = 2
"""Queries before this position are left out: at position 1 the previous key is key 0."""


def ratio_ci(
    numerator: np.ndarray, denominator: np.ndarray, n_boot: int = 200, seed: int = 0
) -> tuple[float, float, float]:
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
    result = stats.bootstrap(
        (numerator, denominator),
        lambda a, b, axis=-1: a.sum(axis) / b.sum(axis),
        paired=True,
        vectorized=True,
        n_resamples=n_boot,
        method="percentile",
        random_state=random_state(seed),
    )
    return value, float(result.confidence_interval.low), float(result.confidence_interval.high)


class ActiveDormantStats(Measurement):
    """Per head and query class, the attention on the first token and on the previous token,
    measured while the model runs: per sequence, head and class, the two attentions summed over
    the class's queries (at positions >= :data:`FIRST_QUERY`), and the queries counted. Memory:
    a few numbers per sequence and head; nothing of size T x T outlives its batch.

    Args:
        sequences: the token set (:class:`~nopelens.probes.stream.Sequences`); key 0 of a
            sequence is its first real token.
        sites: ``blocks.{l}.attn.hook_pattern`` sites.
        query_class: one bool array ``[n_real]`` per sequence; True marks a query of the first
            class (for the BB task: the query token is a trigger).
        classes: names of the two classes, ``{name: flag}``; default ``{"trigger": True,
            "non_trigger": False}``.
        n_boot, seed: bootstrap replicates and seed of the CIs (:func:`ratio_ci`).

    Raises:
        ValueError: if no site is given or ``query_class`` does not match the sequences.
    """

    def __init__(
        self,
        sequences: Sequences,
        sites: Sequence[str],
        query_class: Sequence[np.ndarray],
        classes: dict[str, bool] | None = None,
        n_boot: int = 200,
        seed: int = 0,
    ):
        if not sites:
            raise ValueError("no hook_pattern site was collected")
        lengths = np.diff(sequences.offsets)
        if len(lengths) != len(query_class):
            raise ValueError(f"{len(query_class)} query-class arrays for {len(lengths)} sequences")
        for k, (cls, n) in enumerate(zip(query_class, lengths)):
            if len(cls) != n:
                raise ValueError(f"sequence {k}: {len(cls)} query flags for {n} real tokens")
        self.sequences, self.site_list, self.query_class = sequences, list(sites), query_class
        self.classes = {"trigger": True, "non_trigger": False} if classes is None else classes
        self.n_boot, self.seed = n_boot, seed
        self.sums: dict[str, np.ndarray] = {}  # site -> [class, sequence, head, first/previous]
        self.done = False

    def queries(self, k: int, flag: bool) -> np.ndarray:
        """Sequence ``k``'s queries of the class ``flag``: real positions >= :data:`FIRST_QUERY`."""
        cls = np.asarray(self.query_class[k], bool)
        return np.flatnonzero((cls == flag) & (np.arange(len(cls)) >= FIRST_QUERY))

    def sites(self, batch_index: int) -> list[str]:
        return [] if self.done else self.site_list

    def update(self, site: str, value: Tensor, batch: Batch) -> None:
        real = batch.mask.bool()
        sums = self.sums.setdefault(site, np.zeros((len(self.classes), len(self.query_class), value.shape[1], 2)))
        for r, k in enumerate(range(batch.rows.start, batch.rows.stop)):
            columns = torch.nonzero(real[r]).flatten().to(value.device)
            pattern = value[r][:, columns[:, None], columns[None, :]].float().cpu().numpy()  # [head, n, n]
            for c, flag in enumerate(self.classes.values()):
                queries = self.queries(k, flag)
                sums[c, k, :, 0] = pattern[:, queries, 0].sum(-1)
                sums[c, k, :, 1] = pattern[:, queries, queries - 1].sum(-1)

    def end_pass(self) -> bool:
        self.done = True
        return False

    def spawn(self) -> "ActiveDormantStats":
        return ActiveDormantStats(
            self.sequences, self.site_list, self.query_class, self.classes, self.n_boot, self.seed
        )

    def merge(self, other: "ActiveDormantStats") -> None:
        for site, sums in other.sums.items():
            self.sums[site] = self.sums[site] + sums if site in self.sums else sums

    def result(self) -> pd.DataFrame:
        """:func:`active_dormant_table`'s rows."""
        rows = []
        for site in self.site_list:
            sums = self.sums[site]
            for c, (name, flag) in enumerate(self.classes.items()):
                counts = np.array([len(self.queries(k, flag)) for k in range(len(self.query_class))], dtype=float)
                if counts.sum() == 0:
                    continue
                for head in range(sums.shape[2]):
                    first = ratio_ci(sums[c, :, head, 0], counts, self.n_boot, self.seed)
                    previous = ratio_ci(sums[c, :, head, 1], counts, self.n_boot, self.seed)
                    rows.append(
                        dict(
                            site=site,
                            block=site_block(site),
                            head=head,
                            query_class=name,
                            n_queries=int(counts.sum()),
                            first_mass=first[0],
                            first_mass_ci_low=first[1],
                            first_mass_ci_high=first[2],
                            previous_mass=previous[0],
                            previous_mass_ci_low=previous[1],
                            previous_mass_ci_high=previous[2],
                            dormant=bool(first[0] > GU_EPSILON),
                            active=bool(previous[0] > ACTIVE_THRESHOLD),
                        )
                    )
        return pd.DataFrame(rows)


def active_dormant_table(
    acts: Activations,
    query_class: Sequence[np.ndarray],
    classes: dict[str, bool] | None = None,
    n_boot: int = 200,
    seed: int = 0,
) -> pd.DataFrame:
    """Per head and query class: attention on the first token and on the previous token
    (:class:`ActiveDormantStats` replayed on ``acts``).

    Args:
        acts: activations holding ``blocks.{l}.attn.hook_pattern`` patterns (padding removed, so
            key 0 is the first real token).
        query_class, classes, n_boot, seed: as :class:`ActiveDormantStats`.

    Returns:
        One row per (site, head, class): ``block``, ``head``, ``query_class``, ``n_queries``,
        ``first_mass`` (mean attention on key 0) and ``previous_mass`` (on key i - 1), each with
        ``_ci_low``/``_ci_high``; ``dormant`` (first_mass > Gu's 0.3) and ``active``
        (previous_mass > :data:`ACTIVE_THRESHOLD`).

    Raises:
        ValueError: if no pattern site was collected or ``query_class`` does not match the patterns.
    """
    sites = [site for site in acts.patterns if site.endswith("hook_pattern")]
    if not sites:
        raise ValueError("no hook_pattern site was collected")
    # the sequences as the patterns hold them (the activations may hold patterns only)
    lengths = torch.as_tensor([pattern.shape[-1] for pattern in acts.patterns[sites[0]]])
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    sequences = Sequences.of(torch.zeros(mask.shape, dtype=torch.long), mask)
    stats = ActiveDormantStats(sequences, sites, query_class, classes, n_boot, seed)
    return replay(acts, [stats], sequences=sequences)[0]


class FirstTokenNorms(Measurement):
    """The L2 norm of the first real token's state against the other tokens', per site (and
    head), measured while the model runs: per site and head, the norms (float64) summed over the
    first tokens and over the others, and both counted.

    Args:
        sequences: the token set (:class:`~nopelens.probes.stream.Sequences`).
        sites: residual sites (``[pos, d_model]``: one row) and per-head sites such as ``hook_v``
            (``[pos, head_index, d_head]``: one row per head).
        head_major: the per-head sites among ``sites`` laid out ``[batch, head_index, pos, d_head]``
            (TransformerLens' bridge hands an MLA attention's ``hook_v`` so).

    Raises:
        ValueError: if no token follows the first in any sequence.
    """

    def __init__(self, sequences: Sequences, sites: Sequence[str], head_major: Sequence[str] = ()):
        if (np.diff(sequences.offsets) <= 1).all():
            raise ValueError("every sequence has one token: no other token to compare the first with")
        self.sequences, self.site_list, self.head_major = sequences, list(sites), set(head_major)
        self.sums: dict[str, np.ndarray] = {}  # site -> [first/other, head] summed norms
        self.per_head: dict[str, bool] = {}
        self.done = False

    def sites(self, batch_index: int) -> list[str]:
        return [] if self.done else self.site_list

    def update(self, site: str, value: Tensor, batch: Batch) -> None:
        rows = batch.real(site, value.transpose(1, 2) if site in self.head_major else value).to(torch.float64)
        norms = torch.linalg.vector_norm(rows, dim=-1).reshape(len(rows), -1).cpu().numpy()  # [n, head]
        first = batch.position == 0
        self.per_head[site] = rows.ndim > 2
        sums = np.stack([norms[first].sum(0), norms[~first].sum(0)])
        self.sums[site] = self.sums[site] + sums if site in self.sums else sums

    def end_pass(self) -> bool:
        self.done = True
        return False

    def spawn(self) -> "FirstTokenNorms":
        return FirstTokenNorms(self.sequences, self.site_list, self.head_major)

    def merge(self, other: "FirstTokenNorms") -> None:
        self.per_head.update(other.per_head)
        for site, sums in other.sums.items():
            self.sums[site] = self.sums[site] + sums if site in self.sums else sums

    def result(self) -> pd.DataFrame:
        """:func:`first_token_norms`' rows."""
        n_first = len(self.sequences.offsets) - 1
        n_other = int(self.sequences.offsets[-1]) - n_first
        rows = []
        for site in self.site_list:
            sums = self.sums[site]
            for head in range(sums.shape[1]):
                first_norm, other_norm = sums[0, head] / n_first, sums[1, head] / n_other
                zero = other_norm == 0
                rows.append(
                    dict(
                        site=site,
                        layer=site_layer(site),
                        block=site_block(site),
                        head=head if self.per_head[site] else -1,
                        first_norm=float(first_norm),
                        other_norm=float(other_norm),
                        ratio=float("nan") if zero else float(first_norm / other_norm),
                        note="the other tokens' states are all zero: no ratio" if zero else "",
                    )
                )
        return pd.DataFrame(rows)


def first_token_norms(acts: Activations, sites: Sequence[str]) -> pd.DataFrame:
    """L2 norm of the first real token's state against the other tokens', per site (and head):
    :class:`FirstTokenNorms` replayed on ``acts``.

    Returns:
        ``site``, ``layer`` (residual sites) or ``block``, ``head`` (-1 for residual sites),
        ``first_norm`` (mean over sequences of the norm at position 0), ``other_norm`` (mean over
        the tokens at positions >= 1), ``ratio`` = first / other (< 1 is a value-state drain at
        ``hook_v``, > 1 a residual-state peak) and ``note``: where the other tokens' states are all
        zero the ratio is NaN and the note says so.

    Raises:
        KeyError: for a site that was not collected. ValueError: if no token follows the first.
    """
    return replay(acts, [FirstTokenNorms(Sequences.of_activations(acts), sites)])[0]
