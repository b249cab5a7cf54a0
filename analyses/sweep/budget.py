"""The memory of a streamed run: what it holds besides its batches (the keep budget,
:func:`run_budget`; the probes' statistics, :func:`statistics_bytes`), how its probes' jobs are
grouped so their statistics fit (:func:`statistics_groups`), and how many sequences a forward pass
takes (:func:`auto_batch_size`; the memory it may use:
:func:`~nopelens.analyses.sweep.streamed.memory_allowed`). :func:`~nopelens.analyses.sweep.plan.plan`
reads the same numbers before a run, :func:`~nopelens.analyses.sweep.streamed.measure_streamed`
during it. Their ``m`` is the run's :class:`~nopelens.analyses.sweep.streamed.Measurements` (not
annotated: streamed imports this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from nopelens.probes import collect
from nopelens.probes.collect import is_pattern_site, site_block
from nopelens.probes.stream import AUTO_KEEP_BYTES, KeepBudget

if TYPE_CHECKING:
    from ..subjects import Subject


def auto_keep_bytes(m, shapes: dict[str, tuple[int, ...]]) -> int:
    """The default keep budget: :data:`~nopelens.probes.stream.AUTO_KEEP_BYTES` or a quarter of the
    memory the run may use, whichever is less, and no more than leaves room, within
    :data:`STATISTICS_SHARE` of that memory, for the fit of the largest site (its unpacked
    statistics, times :data:`STATISTICS_OVERHEAD`)."""
    room = int(STATISTICS_SHARE * m.free - STATISTICS_OVERHEAD * _largest_fit(m.jobs(), shapes))
    return max(0, min(AUTO_KEEP_BYTES, m.free // 4, room))


def _largest_fit(jobs: list, shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of the largest job's statistics as a fit reads them (Gram matrices unpacked)."""
    return max((job_statistics_bytes(job, shapes, packed=False) for job in jobs), default=0)


STATISTICS_OVERHEAD = 1.5
"""Peak memory of a run whose statistics are all summed at once, per byte of :func:`statistics_bytes`:
the fits' grouped copies and the allocator's slack on top. Measured 1.35-1.43 with nothing kept on
a 1024-wide SmolLM3-shaped model (QA, 2026-12-01)."""


STATISTICS_SHARE = 0.5
"""The share of the memory a run may use that what it holds besides its batches may take (one
group's statistics, or its kept features and one site's statistics, with the fits' overhead:
:func:`held_bytes`); the rest is for the forward passes. :func:`~nopelens.analyses.sweep.plan.plan`
refuses a run that cannot
keep to it."""


def held_bytes(m, shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes a streamed run holds besides its batches, the most of any of its groups: a group whose
    features fit the keep budget holds them and one job's statistics at a time (times
    :data:`STATISTICS_OVERHEAD`), any other the statistics of all its jobs at once (times the same)."""
    groups = m.groups if m.groups is not None else statistics_groups(m, shapes)
    return max((group_held_bytes(m, group, shapes) for group in groups), default=0)


def group_held_bytes(m, group: list, shapes: dict[str, tuple[int, ...]]) -> int:
    kept, summed = kept_and_summed_bytes(m, group, shapes)
    return kept if group_kept(m, group, shapes) else summed


def kept_and_summed_bytes(m, group: list, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """What a run over ``group`` holds with its features kept (they and one job's unpacked
    statistics at a time, times :data:`STATISTICS_OVERHEAD`) and with none kept (every job's packed
    statistics at once, times the same, and the unpacked copy of the one being fitted)."""
    fit = _largest_fit(group, shapes)
    kept = feature_bytes(m, shapes, group) + int(STATISTICS_OVERHEAD * fit)
    return kept, int(STATISTICS_OVERHEAD * sum(job_statistics_bytes(job, shapes) for job in group)) + fit


def group_kept(m, group: list, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether a run over ``group`` keeps its features: they all fit the keep budget, and the run
    holds them within :data:`STATISTICS_SHARE` of the memory (or keeping is what fits best), so a
    keep budget is never the reason a run is refused."""
    if m.budget.limit is not None and feature_bytes(m, shapes, group) > m.budget.limit:
        return False
    kept, summed = kept_and_summed_bytes(m, group, shapes)
    return kept <= STATISTICS_SHARE * m.free or kept <= summed


def run_budget(m, group: list, shapes: dict[str, tuple[int, ...]]) -> KeepBudget:
    """The keep budget of the run over ``group`` (jobs of ``m``'s probes): no limit when all its
    features fit ``m.budget`` (one pass), else nothing kept (a second pass predicts). Keeping part
    of them would save only part of the second pass while holding the budget on top of every
    job's statistics; at the scale of the models users study, where the features of a few
    sequences pass any budget, that part is small."""
    return KeepBudget(None if group_kept(m, group, shapes) else 0)


def ablation_budget(m) -> KeepBudget:
    """The keep budget of each run of the sink ablation (one residual site, as wide as the clean
    probes' first job): :func:`run_budget` of that site."""
    jobs = m.ablation.jobs[:1] if m.ablation is not None else []
    return run_budget(m, jobs, m.shapes)


def statistics_groups(m, shapes: dict[str, tuple[int, ...]]) -> list[list]:
    """The probes' jobs (one feature matrix each) in groups whose statistics fit the memory the
    run may use, one streamed run per group.

    When every batch's features fit the keep budget, and they and the largest job's statistics
    fit :data:`STATISTICS_SHARE` of ``m.free``, each job is fitted alone from its kept features at
    the end of the pass: one group. Otherwise every job of a run sums its float64 statistics at
    once (:func:`run_budget`), which grow with the sites and their width (about 1 GB per layer of
    a 2048-wide model), not with the tokens. Then the jobs are taken in the order of the deepest
    block they read, and a group closes before its statistics, times :data:`STATISTICS_OVERHEAD`,
    and the unpacked copy one fit reads would pass that share; each run stops after its deepest
    site, so G groups cost between 1 and G forward passes' worth of compute. A job too large for
    that share alone gets a group of its own, which :func:`~nopelens.analyses.sweep.plan.plan`
    refuses. The numbers do not
    depend on the grouping (each job's fit uses its own statistics only).
    """
    jobs = m.jobs()
    room = STATISTICS_SHARE * m.free
    if m.budget.limit is None or group_kept(m, jobs, shapes) and group_held_bytes(m, jobs, shapes) <= room:
        return [jobs]  # features kept and fitted job by job
    room -= _largest_fit(jobs, shapes)  # the unpacked copy of the job being fitted
    groups: list[list] = [[]]
    size = 0.0
    for job in sorted(jobs, key=_depth):
        need = STATISTICS_OVERHEAD * job_statistics_bytes(job, shapes)
        if groups[-1] and size + need > room:
            groups.append([])
            size = 0.0
        groups[-1].append(job)
        size += need
    return groups


def _depth(job) -> int:
    """The deepest block a job's sites are in (-1: before block 0, e.g. ``hook_embed``)."""
    return max(-1 if site_block(site) is None else site_block(site) for site in job.sites)


def feature_bytes(m, shapes: dict[str, tuple[int, ...]], group: list | None = None) -> int:
    """Bytes of the features a run keeps when the keep budget holds them all, for the jobs of
    ``group`` (None: every job of ``m``'s probes): per row of each job (a token, or a pair), its
    features (a site's activations in the model's dtype; pair and q.k features in float32; score
    reads in float64) and its row index."""
    jobs = m.jobs() if group is None else group
    return sum(_job_feature_bytes(job, shapes, m.activation_bytes) for job in jobs)


def _job_feature_bytes(job, shapes: dict[str, tuple[int, ...]], activation_bytes: int) -> int:
    item = {"rows": activation_bytes, "float32": 4}.get(job.form, 8)
    return (item * n_features(job, shapes) + 8) * len(job.layout.groups)


MAX_AUTO_BATCH = 32
"""``--batch-size auto`` runs at most this many sequences per forward pass (the fixed default before it)."""

ACTIVATION_COPIES = 32
"""How many float32 ``[pos, width]`` arrays :func:`sequence_bytes` counts per sequence, ``width`` the
widest hooked site per token: the residual stream, q, k, v and their rotations, the gated MLP's
three intermediates of about 4 x d_model, and the float32 copies the hooks take, with room to spare."""


def sequence_bytes(subject: Subject, shapes: dict[str, tuple[int, ...]]) -> int:
    """Upper estimate of the memory one sequence adds to a hooked forward pass of ``subject``.

    ``T (4 d_vocab + 12 n_heads T + 4 * ACTIVATION_COPIES * width)`` bytes for ``T`` tokens: the
    logits in float32, three float32 ``[head_index, T, T]`` arrays (scores, softmax, pattern; eager
    attention materializes them) and :data:`ACTIVATION_COPIES` float32 arrays ``[T, width]``.
    Only one layer's attention is alive at once; the statistics and kept features are counted
    apart (:func:`auto_batch_size`'s ``reserved``).

    Args:
        subject: the model and its tokens ``[batch, T]``.
        shapes: each hooked site's per-token shape (:func:`site_shapes`).

    Returns:
        Bytes per sequence.
    """
    T = int(subject.tokens.shape[1])
    config = subject.hf if subject.hf is not None else subject.model.cfg
    width = max([int(np.prod(shape)) for site, shape in shapes.items() if not is_pattern_site(site)] + [1])
    return T * (4 * int(config.d_vocab) + 12 * int(config.n_heads) * T + 4 * ACTIVATION_COPIES * width)


def auto_batch_size(sequence: int, available: int, reserved: int, most: int = MAX_AUTO_BATCH) -> int:
    """Sequences per forward pass for ``--batch-size auto``: as many as fit half the memory left
    after ``reserved`` (the other half is margin for what :func:`sequence_bytes` does not count),
    at most ``most`` and at least 1.

    Args:
        sequence: bytes one sequence adds to a forward pass (:func:`sequence_bytes`), > 0.
        available: bytes free on the model's device (:func:`~nopelens.probes.stream.available_memory`).
        reserved: bytes the run holds besides its batches (statistics, kept features).
        most: the largest batch.

    Returns:
        The batch size, in ``[1, most]``.

    Example:
        >>> auto_batch_size(2**30, 40 * 2**30, 8 * 2**30)  # 1 GiB per sequence, 16 GiB of 32 left
        16
        >>> auto_batch_size(2**20, 40 * 2**30, 0), auto_batch_size(2**35, 2**30, 0)
        (32, 1)
    """
    room = max(0, available - reserved) // 2
    return int(max(1, min(most, room // max(1, sequence))))


def site_shapes(subject: Subject, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Each named site's output shape per token (``[pos, ...]`` dropped; a pattern or score site: its
    head count first), read from one forward pass over the first three tokens of one sequence."""
    n = min(3, subject.tokens.shape[1])
    with torch.no_grad():
        acts = collect(
            subject.model, subject.tokens[:1, :n], list(names), attention_mask=subject.attention_mask[:1, :n]
        )
    shapes = {site: tuple(value.shape[1:]) for site, value in acts.acts.items()}
    shapes.update({site: tuple(value[0].shape) for site, value in acts.patterns.items()})
    return shapes


# ----------------------------------------------------------------------------- sizes of the statistics


def n_features(job, shapes: dict[str, tuple[int, ...]]) -> int:
    shape = shapes[job.sites[0]]
    d = int(np.prod(shape))
    if job.features == "concat":
        return 2 * d
    if job.features == "bilinear_outer":
        return int(shape[-2] * shape[-1] ** 2)
    if job.features == "score":
        return int(shape[0])
    return d  # token, difference, bilinear_elementwise


def statistics_bytes(probe, shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of the float64 per-block statistics of a streamed probe measurement's jobs
    (:class:`~nopelens.probes.fitting.BlockMoments`: Gram matrix, sums, extremes, X^T y, class
    sums per cell of the folds; each Gram matrix packed as its upper triangle), from each site's
    per-token shape."""
    return sum(job_statistics_bytes(job, shapes) for job in probe.jobs)


def job_statistics_bytes(job, shapes: dict[str, tuple[int, ...]], packed: bool = True) -> int:
    """:func:`statistics_bytes` of one job (one feature matrix); ``packed=False``: with full Gram
    matrices, as a fit reads them."""
    layout, d = job.layout, n_features(job, shapes)
    classes = sum(len(values) for values in layout.class_values)
    gram = d * (d + 1) // 2 if packed else d * d
    return 8 * layout.n_cells * (gram + d * (4 + len(layout.values) + classes))
