"""The plan of a streamed probe (``nopelens probe --plan``), before any forward pass: how many
forward passes and tokens :func:`~nopelens.analyses.sweep.streamed.measure_streamed` will run, how much
memory its statistics need and hold at once, whether they fit the memory the run may use
(a shortfall is refused before the first pass), and how long it will take, measured here.

The measurements planned and their memory budgets (keep budget, batch size, groups of sites) are
:mod:`nopelens.analyses.sweep.streamed`'s; this module counts and times them.
"""

from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from nopelens.models.hf_loading import attention_shortfall
from nopelens.models.placement import model_device
from nopelens.probes.collect import forward_with_hooks, site_block
from nopelens.probes.fitting import ALPHAS, fit_folds, penalty_path, spd_solve
from nopelens.probes.linear import sequence_splits
from nopelens.probes.metrics import REGRESSION_METRICS, bootstrap_scores
from nopelens.probes.stream import available_memory

from ..subjects import Subject
from .budget import (
    MAX_AUTO_BATCH,
    STATISTICS_SHARE,
    ablation_budget,
    feature_bytes,
    group_held_bytes,
    group_kept,
    held_bytes,
    job_statistics_bytes,
    kept_and_summed_bytes,
    n_features,
    sequence_bytes,
    site_shapes,
    statistics_bytes,
)
from .eta import FitRates, FitWork
from .reads import SweepSites
from .streamed import Measurements, measurements


def _more_memory_hint(m: Measurements) -> str:
    if m.free_source.startswith("allowed"):
        return "give a larger --memory-mib, or run where more memory is free"
    return "run where more memory is free"


def _largest_job(m: Measurements, shapes: dict[str, tuple[int, ...]]):
    """(the job with the largest statistics, their bytes); (None, 0) without jobs."""
    sizes = [(job, job_statistics_bytes(job, shapes)) for job in m.jobs()]
    return max(sizes, key=lambda pair: pair[1], default=(None, 0))


def _keeping_hint(m: Measurements, shapes: dict[str, tuple[int, ...]]) -> str:
    """For a refusal: the keep budget under which every group that does not fit would fit by
    keeping its features (fitted one site at a time), if there is one ("" otherwise)."""
    room, need = STATISTICS_SHARE * m.free, 0
    for group in m.groups:
        if group_held_bytes(m, group, shapes) > room:
            if kept_and_summed_bytes(m, group, shapes)[0] > room:
                return ""
            need = max(need, feature_bytes(m, shapes, group))
    return f"keep the features (--keep-mib {-(-need // 2**20)} or more) or " if need else ""


PLAN_WIDTH = 100
"""Columns a line of :meth:`Plan.describe` may take."""


@dataclass
class Plan:
    """What a streamed probe will do, before it runs."""

    forward_passes: int
    tokens: int
    statistics_bytes: int
    keep_bytes: int
    eta_seconds: float | None
    eta_note: str
    ablation_passes: int = 0  # of the forward passes, those with one block's first key removed
    ablated_blocks: int = 0
    batch_size: int = MAX_AUTO_BATCH
    shortfall: str | None = None  # why the statistics cannot fit the memory free on the device (None: they can)
    groups: int = 1  # runs over groups of sites whose statistics fit the memory (:func:`statistics_groups`)
    held_bytes: int = 0  # the most the run holds besides its batches (:func:`held_bytes`)
    measurements: Measurements | None = field(default=None, repr=False)  # what the run measures, as planned
    stripped_passes: int = 0  # of the forward passes, those over the sequences without BOS (the sink table's)
    second_passes: int = 0  # of the forward passes, the probes' second passes (features over the keep budget)
    ablation_second_passes: int = 0  # of the second passes, the sink ablation's (also among its ablation passes)
    placement: list[str] = field(default_factory=list)  # a device-mapped model's placement, in words

    def describe(self, name: str, width: int = PLAN_WIDTH) -> str:
        """The plan in words: a headline, then one item per part of the work, memory and ETA, each
        wrapped at ``width`` columns (``nopelens probe`` prints it on stderr, ``--plan`` on stdout)."""
        eta = f"about {_duration(self.eta_seconds)}: {self.eta_note}" if self.eta_seconds is not None else self.eta_note
        blocks = "block" if self.ablated_blocks == 1 else "blocks"
        among = (
            f", {self.ablation_second_passes} of the sink ablation's among them" if self.ablation_second_passes else ""
        )
        passes = "a second pass" if self.second_passes == 1 else "second passes"
        items = [
            f"the sites in {self.groups} groups whose statistics fit the memory, a run each, stopped after its "
            "deepest site"
            if self.groups > 1
            else "",
            f"{self.stripped_passes} of them over the sequences without BOS, for the sink table"
            if self.stripped_passes
            else "",
            f"{self.ablation_passes} of them for the sink ablation of {self.ablated_blocks} {blocks}, each stopped "
            "after its block"
            if self.ablated_blocks
            else "",
            f"{self.second_passes} of them {passes} to predict{among}, where a run's features do not all fit the "
            "keep budget within half the memory the run may use"
            if self.second_passes
            else "no second pass: every run's features fit the keep budget",
            *self.placement,
            f"statistics {self.statistics_bytes / 2**20:,.1f} MiB in all, at most {self.held_bytes / 2**20:,.1f} MiB "
            f"held at once with the kept features or the fits' overhead (keep budget "
            f"{self.keep_bytes / 2**20:,.1f} MiB)",
            f"ETA {eta}",
            "WILL NOT FIT (the error line says why)" if self.shortfall else "",
        ]
        head = (
            f"nopelens: plan for {name}: {self.forward_passes} forward passes over {self.tokens:,} tokens in "
            f"batches of at most {self.batch_size} sequence{'s' * (self.batch_size != 1)}"
        )
        lines = [textwrap.fill(head, width, subsequent_indent="    ", break_on_hyphens=False, break_long_words=False)]
        lines += [
            textwrap.fill(
                item,
                width,
                initial_indent="  - ",
                subsequent_indent="    ",
                break_on_hyphens=False,
                break_long_words=False,
            )
            for item in items
            if item
        ]
        return "\n".join(lines)


CALIBRATION_MAX_WIDTH = 1024
"""Widest d at which :func:`fit_rates` times the fits' kernels; wider fits scale by d^3 from it."""


def fit_work(m: Measurements, shapes: dict[str, tuple[int, ...]]) -> FitWork:
    """Count the linear algebra of every job's fits (:class:`~nopelens.analyses.sweep.eta.FitWork`), from
    the plan alone: per ridge family K(K - 1)/2 penalty paths (the grouped inner CV's fitting sets,
    each shared by two outer folds), K x t Cholesky solves and K(K - 1) validation products over
    the penalty grid; per LDA family K x t solves with their class means; one Gram matrix of
    every row per split set, and the out-of-fold predictions (K folds, t targets, d features).

    Returns:
        :class:`~nopelens.analyses.sweep.eta.FitWork`: sums of d^3 (paths, solves), flops, samples scored
        and call counts.
    """
    paths = solves = flops = scored = 0.0
    calls = np.zeros(3, dtype=np.int64)
    for job in m.jobs():
        d, n = n_features(job, shapes), len(job.layout.groups)
        families = job.layout.families
        flops += n * d * d * len({id(family.splits) for family in families})
        for family in families:
            k, t = len(family.splits), len(family.labels)
            scored += t * int((family.fold >= 0).sum())
            calls += (family.task == "regression", family.task != "regression", t)
            if family.task == "regression":
                paths += k * (k - 1) / 2 * d**3
                solves += k * t * d**3
                flops += k * (k - 1) * 2 * d * d * len(ALPHAS) * t + 2 * n * d * t
            else:
                classes = len(np.unique(family.labels["linear"]))
                solves += k * t * d**3
                flops += k * t * 4 * d * d * classes + 2 * n * d * classes * t
    return FitWork(paths, solves, flops, scored, tuple(int(c) for c in calls))


def fit_rates(device: torch.device, width: int, n_boot: int, n_splits: int) -> FitRates:
    """Time the fits' kernels here, on ``device``: a penalty path over the ridge grid, a Cholesky
    solve and a matrix product at ``width`` features (at most :data:`CALIBRATION_MAX_WIDTH`), the
    bootstrap scoring of 4,096 samples with ``n_boot`` replicates, and the fixed cost of a family
    (a ridge and an LDA fit of three targets over ``n_splits`` folds at 4 features) and of a scoring
    (64 samples).

    Returns:
        :class:`~nopelens.analyses.sweep.eta.FitRates`: seconds per d^3, per flop, per sample and per call.
    """
    d = max(32, min(int(width), CALIBRATION_MAX_WIDTH))
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(2 * d, d, generator=generator, dtype=torch.float64).to(device)
    C = X.T @ X
    b = X.T @ torch.randn(2 * d, 3, generator=generator, dtype=torch.float64).to(device)
    C.diagonal().add_(1.0)
    path = _seconds(lambda: penalty_path(C, b, ALPHAS), device) / d**3
    solve = _seconds(lambda: spd_solve(C, b[:, :1]), device) / d**3
    product = _seconds(lambda: X.T @ X, device) / (4.0 * d**3)
    rng = np.random.default_rng(0)

    def scoring(n: int) -> float:
        y = rng.normal(size=n)
        return _seconds(
            lambda: bootstrap_scores(y, y + rng.normal(size=n), np.arange(n) % 32, REGRESSION_METRICS, n_boot),
            torch.device("cpu"),
        )

    groups = np.arange(16 * n_splits) % (2 * n_splits)
    splits = sequence_splits(groups, n_splits)
    small = rng.normal(size=(len(groups), 4))
    targets = [rng.integers(0, 4, size=len(groups)) for _ in range(3)]
    family = [
        _seconds(lambda: fit_folds(small, targets, groups, splits, task, device=device), device)
        for task in ("regression", "classification")
    ]
    score = max(scoring(4096) - scoring(64), 0.0) / 4096
    return FitRates(path, solve, product, score, (*family, scoring(64)))


def _seconds(work, device: torch.device) -> float:
    """Wall seconds of ``work()`` (after one untimed call), the device's queue drained."""
    work()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    work()
    synchronize()
    return time.perf_counter() - start


def block_seconds(subject: Subject, sites: Sequence[str], batch_size: int) -> float:
    """Wall seconds one block of one sequence costs in a hooked forward pass: the first batch
    (``batch_size`` sequences) run through the shallowest block any of ``sites`` is in, hooked
    there (with hooks that keep nothing) and stopped after it, as the run's passes stop, divided
    by the sequences and the blocks run (embedding included).

    Returns:
        Seconds per sequence and block (wall clock, the device's queue drained).
    """
    model, device = subject.model, model_device(subject.model)
    first = min(site_block(site) or 0 for site in sites)
    shallow = [site for site in sites if (site_block(site) or 0) == first]
    rows = slice(0, batch_size)
    mask = subject.attention_mask[rows]
    mask = None if bool(mask.all()) else mask.to(device)
    start = time.perf_counter()
    forward_with_hooks(model, model.hook_dict, shallow, subject.tokens[rows].to(device), mask, lambda site, value: None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / (len(subject.tokens[rows]) * (first + 1))


def _eta(subject: Subject, settings, m: Measurements, shapes, block_passes: float) -> tuple[float, str]:
    """(seconds, what they are made of): the forward passes (:func:`block_seconds` times the blocks
    the sequences run through, ``block_passes``), a device-mapped model's offload traffic (its
    offloaded bytes per full pass over the read rate measured here, times the full passes the
    batches make, :meth:`~nopelens.models.placement.PlacementReport.offload_seconds`) and the fits,
    counted (:func:`fit_work`) and timed here (:func:`fit_rates`) at the width of the widest job."""
    device = model_device(subject.model)
    forward = block_seconds(subject, m.sites.all(), m.batch_size) * block_passes
    report = getattr(subject.model, "placement", None)
    traffic, traffic_note = 0.0, ""
    if report is not None and report.offloaded_bytes:
        full_passes = block_passes / (m.batch_size * subject.n_layers)
        traffic = report.offload_seconds() * full_passes
        traffic_note = (
            f", {_duration(traffic)} of offload traffic ({report.offloaded_bytes / 2**20:,.1f} MiB per full "
            f"pass, {full_passes:,.1f} full passes, at {report.measure_read_rate() / 2**20:,.0f} MiB/s "
            "measured here)"
        )
    jobs = m.jobs()
    width = max((n_features(job, shapes) for job in jobs), default=1)
    fits = fit_rates(device, width, settings.n_boot, settings.n_splits).seconds(fit_work(m, shapes)) if jobs else 0.0
    return forward + traffic + fits, (
        f"{_duration(forward)} of forward passes{traffic_note} and {_duration(fits)} of "
        f"fits (a batch's first block timed here, the fits' factorizations and products "
        f"counted and timed here at d = {min(width, CALIBRATION_MAX_WIDTH)})"
    )


def _placement(subject: Subject, m: Measurements, shapes) -> tuple[list[str], str | None]:
    """A device-mapped model's placement in words (weights, statistics and batches per device,
    what is offloaded), and why it cannot run, if it cannot: an execution device other than the
    main one (whose memory the run's own check counts) without room for the statistics of the
    sites on its blocks and one batch's activations."""
    report = getattr(subject.model, "placement", None)
    if report is None:
        return [], None
    per_device: dict[str, int] = {}
    for job in m.jobs():
        device = str(report.site_device(site_block(job.sites[0])))
        per_device[device] = per_device.get(device, 0) + job_statistics_bytes(job, shapes)
    batch = sequence_bytes(subject, shapes) * m.batch_size
    main = str(model_device(subject.model))
    for device, need in per_device.items():
        free = available_memory(torch.device(device))
        if device != main and need + batch > free:
            return report.lines(per_device, batch), (
                f"the sites on {device}'s blocks need {need / 2**20:,.1f} MiB of statistics there, and a batch up to "
                f"{batch / 2**20:,.1f} MiB, more than the {free / 2**20:,.1f} MiB free on {device}: give it fewer "
                "layers (--max-memory, or a --device-map file), fewer --layers, or a smaller --batch-size"
            )
    return report.lines(per_device, batch), None


def _duration(seconds: float) -> str:
    """``45 s``, ``4 min 10 s``, ``25 min``, ``3.5 h``.

    Example:
        >>> _duration(44.6), _duration(250), _duration(298), _duration(1500), _duration(12600)
        ('45 s', '4 min 10 s', '5 min', '25 min', '3.5 h')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 600:
        minutes, rest = divmod(int(round(seconds / 10)) * 10, 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan(subject: Subject, settings, sites: SweepSites) -> Plan:
    """The forward passes, tokens and statistics' memory of
    :func:`~nopelens.analyses.sweep.streamed.measure_streamed`, and how long it will take, measured here.

    Forward passes: one per batch, plus one per batch of the sequences without BOS (the sink
    table's second condition), plus one per batch and ablated block for the sink ablation (each
    stopped after its block, so the n blocks cost about (n + 1) / 2 full passes; its tokens are
    counted in full); the probes add a second pass over every batch to a run whose features do not
    all fit the keep budget (:func:`~nopelens.analyses.sweep.budget.run_budget`, :func:`ablation_budget`).
    When the statistics of every site do not fit the memory the run may use, the sites run in groups
    (:func:`~nopelens.analyses.sweep.budget.statistics_groups`), one run of the passes above each
    (counted in full, though each stops after its deepest site). A run that cannot hold what it must besides
    its batches within :data:`STATISTICS_SHARE` of that memory is a shortfall: refused before any
    forward pass.

    The ETA is measured on this machine and device, for models of any size: the first batch run
    through its first hooked block (:func:`block_seconds`), scaled by the blocks every pass runs
    (an ablation pass stops after its block; a group's run is counted in full), plus the fits:
    their penalty paths, Cholesky solves, matrix products and bootstrap scoring counted from the
    plan (:func:`fit_work`) and timed at the widest job's width (at most
    :data:`CALIBRATION_MAX_WIDTH`, scaled by d^3 beyond: :func:`fit_rates`). It leaves out the
    measurements' own work inside the hooks, so it runs low. Nothing is estimated for a run that
    does not fit.
    """
    shapes = site_shapes(subject, sites.all())
    m = measurements(subject, settings, sites, shapes)
    n_batches = len(m.sequences.batches(m.batch_size))
    stats = sum(statistics_bytes(probe, shapes) for probe in m.all_probes())
    keep = m.budget.limit
    # a group's second pass: only when its features do not all fit the keep budget
    runs = sum(1 if group_kept(m, group, shapes) else 2 for group in m.groups)
    stripped_passes = n_batches if m.stripped is not None else 0
    passes = n_batches * runs + stripped_passes
    tokens = int(m.sequences.n_samples) * runs + (int(m.stripped.n_samples) if m.stripped is not None else 0)
    ablated = m.ablated_blocks(subject.n_layers)
    twice = 1 if ablation_budget(m).limit is None else 2  # one residual site per ablated run, fitted alone
    ablation_passes = n_batches * twice * len(ablated)
    second_passes = n_batches * (runs - len(m.groups) + (twice - 1) * len(ablated))
    tokens += int(m.sequences.n_samples) * twice * len(ablated)
    passes += ablation_passes
    device = model_device(subject.model)
    shortfall = None
    held = held_bytes(m, shapes)
    if held > STATISTICS_SHARE * m.free:  # a group of one job: its statistics alone do not fit
        largest, size = _largest_job(m, shapes)
        shortfall = (
            f"the probes' statistics need {size / 2**20:,.1f} MiB for {largest.site} ({largest.features}) "
            f"alone (float64 on {device.type}); with the fits' overhead the run would hold "
            f"{held / 2**20:,.1f} MiB besides its batches, more than half of the {m.free / 2**20:,.1f} MiB "
            f"{m.free_source} (the rest is for the forward passes); they grow with the sites' width, not "
            f"with the tokens: {_keeping_hint(m, shapes)}{_more_memory_hint(m)}"
        )
    T, n_heads = subject.tokens.shape[1], int((subject.hf or subject.model.cfg).n_heads)
    if shortfall is None and m.sites.patterns:
        shortfall = attention_shortfall(
            T, n_heads, m.activation_bytes, m.free - held, f"{m.free_source} besides what the run holds"
        )
    placement, placement_shortfall = _placement(subject, m, shapes)
    shortfall = shortfall or placement_shortfall
    eta, note = None, "not estimated: the run does not fit"
    if shortfall is None:
        depth = max(site_block(site) or 0 for site in m.sites.all()) + 1
        n, stripped = int(m.sequences.n_sequences), int(m.stripped.n_sequences) if m.stripped else 0
        block_passes = (n * runs + stripped) * depth + n * twice * sum(block + 1 for block in ablated)
        eta, note = _eta(subject, settings, m, shapes, block_passes)
    return Plan(
        passes,
        tokens,
        stats,
        keep,
        eta,
        note,
        ablation_passes,
        len(ablated),
        m.batch_size,
        shortfall,
        len(m.groups),
        held,
        m,
        stripped_passes,
        second_passes,
        n_batches * (twice - 1) * len(ablated),
        placement,
    )
