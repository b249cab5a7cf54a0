"""How long a sweep has left: an estimate that knows which tasks train and which only measure.

A sweep's tasks differ by orders of magnitude: a zoo model that is not cached yet trains for a
minute or more before it is measured, a cached one or a control is measured in seconds. An ETA
that extrapolates the first task's time to all of them (tqdm's) is wrong both ways, so the sweep's
bar shows this one instead.

The model (:class:`SweepETA`): a task costs ``train_work * train_rate + measure_work *
measure_rate`` seconds. The work units are fixed per task before it runs (:class:`TaskWork`):
training work is steps x tokens per step x parameters (the cost of a training step grows with
both), measuring work is layers x (sequences x tokens + a fixed overhead). Each rate starts at a prior measured on
the zoo's text models on one idle core, times this machine's speed as measured when the sweep
starts (:func:`speed_factor`: a fixed piece of the fits' arithmetic timed here, against its time
where the priors were measured, so a slower or busier machine gets a longer opening ETA), and
becomes the observed rate (seconds over work, summed over the finished tasks of that kind) as soon
as one such task has finished. With ``jobs`` workers the remaining cost is shared
among ``min(jobs, tasks left)`` of them, less the time spent since the last task finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable

import torch

TRAIN_PRIOR = 5e-11
"""Seconds per unit of training work on one thread: ``text-nope-4l`` (1000 steps of 16 x 64
tokens, 0.85 M parameters) trains in about 45 s."""

MEASURE_PRIOR = 2e-4
"""Seconds per unit of measuring work on one thread: a 4-block text model read on 80 sequences
of 64 tokens (5 layers) is probed in about 10 s."""

MEASURE_OVERHEAD_TOKENS = 5120
"""Tokens' worth of measuring work each layer costs whatever the batch (fits, folds, bootstrap)."""

SPEED_PROBE_SECONDS = 0.1
"""Seconds :func:`speed_probe` takes on one core of the machine the priors were measured on (its
CPU time there: 0.097-0.100 s over four runs, QA 2026-12-07)."""


def speed_probe(repeats: int = 20) -> float:
    """Wall seconds of a fixed piece of the probes' arithmetic here: ``repeats`` Gram matrices of
    2048 x 256 float64 features and their Cholesky factors (a fit's kernels), on the caller's threads."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2048, 256, generator=generator, dtype=torch.float64)
    ridge = torch.eye(256, dtype=torch.float64)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.linalg.cholesky(features.T @ features + ridge)
    return time.perf_counter() - start


def speed_factor() -> float:
    """How much longer than where the priors were measured this machine takes now (>= 1: slower
    or busy; :func:`speed_probe` over :data:`SPEED_PROBE_SECONDS`), at least 0.1."""
    return max(0.1, speed_probe() / SPEED_PROBE_SECONDS)


@dataclass(frozen=True)
class TaskWork:
    """What one sweep task will do, in work units (see the module docstring).

    Attributes:
        train_steps: optimizer steps it trains for first (0: loaded from the cache or built).
        train_work: steps x tokens per step x parameters (0 when it does not train).
        measure_work: (layers + 1) x (sequences x tokens per sequence + :data:`MEASURE_OVERHEAD_TOKENS`).
        estimated: False where the model's size is not read ahead (an HF or checkpoint directory):
            the priors say nothing about it, so no time is printed for it.
    """

    train_steps: int
    train_work: float
    measure_work: float
    estimated: bool = True

    @property
    def trains(self) -> bool:
        return self.train_steps > 0


class SweepETA:
    """Remaining seconds of a sweep (see the module docstring).

    Args:
        work: the work of every task of the sweep still to run, by task key.
        jobs: tasks that run at once.
        speed: the priors' factor until a rate is observed (:func:`speed_factor`, measured when the
            sweep starts; 1: the priors as they are).

    Example:
        >>> eta = SweepETA({"train": TaskWork(1000, 1e12, 25600), "read": TaskWork(0, 0, 25600)})
        >>> round(eta.remaining()), eta.describe()
        (60, 'about 60 s left: 1 to train, 1 to measure')
        >>> eta.finished("train", train_seconds=200.0, measure_seconds=20.0)
        >>> round(eta.remaining())  # the measuring rate is now observed: 20 s per such task
        20
    """

    def __init__(self, work: dict[Hashable, TaskWork], jobs: int = 1, speed: float = 1.0):
        self.work = dict(work)
        self.jobs = max(1, jobs)
        self.speed = speed
        self.left = set(self.work)
        self.seconds = {"train": 0.0, "measure": 0.0}
        self.units = {"train": 0.0, "measure": 0.0}

    def rate(self, kind: str) -> float:
        """Seconds per work unit of ``kind`` (``train`` or ``measure``): observed, else the prior
        times :attr:`speed`."""
        if self.units[kind] > 0:
            return self.seconds[kind] / self.units[kind]
        return (TRAIN_PRIOR if kind == "train" else MEASURE_PRIOR) * self.speed

    def cost(self, key: Hashable) -> float:
        """Estimated seconds of task ``key``."""
        work = self.work[key]
        return work.train_work * self.rate("train") + work.measure_work * self.rate("measure")

    def finished(self, key: Hashable, train_seconds: float, measure_seconds: float) -> None:
        """Record that task ``key`` is done, and how long it trained and measured."""
        work = self.work[key]
        self.left.discard(key)
        if work.trains and train_seconds > 0:
            self.seconds["train"] += train_seconds
            self.units["train"] += work.train_work
        else:  # nothing trained: loading (cache, circuit, HF) counts as measuring
            measure_seconds += train_seconds
        if work.measure_work > 0:
            self.seconds["measure"] += measure_seconds
            self.units["measure"] += work.measure_work

    def remaining(self, since_last: float = 0.0) -> float:
        """Seconds left, ``since_last`` seconds after the last task finished (or the start)."""
        left = [key for key in self.left if self.work[key].estimated]
        if not left:
            return 0.0
        total = sum(self.cost(key) for key in left)
        return max(0.0, total / min(self.jobs, len(left)) - since_last)

    def describe(self, since_last: float = 0.0) -> str:
        """``about 4 min left: 1 to train, 3 to measure`` (or ``done``); the tasks whose size is not
        known ahead are counted apart (``1 not estimated``), and get no time."""
        if not self.left:
            return "done"
        unknown = sum(not self.work[key].estimated for key in self.left)
        training = sum(self.work[key].trains for key in self.left)
        counts = f"{training} to train, {len(self.left) - training} to measure"
        if unknown == len(self.left):
            return f"time left not estimated: {counts}"
        seconds = self.remaining(since_last)
        when = f"about {seconds:.0f} s left" if seconds < 90 else f"about {seconds / 60:.0f} min left"
        return f"{when}{f' ({unknown} not estimated)' if unknown else ''}: {counts}"


# ----------------------------------------------------------------------------- a streamed probe run


@dataclass(frozen=True)
class FitWork:
    """The linear algebra of a streamed probe run's fits, counted from its plan before the run.

    Attributes:
        paths: sum of d^3 over the penalty paths (one per inner fitting set of a ridge family's
            grouped inner CV, :func:`~nopelens.probes.fitting.penalty_path`).
        solves: sum of d^3 over the Cholesky solves (ridge at each fold's penalty, LDA).
        flops: floating-point operations of the matrix products (Gram matrices, validation
            errors, out-of-fold predictions).
        scored: samples scored, summed over probes (each with every metric and bootstrap replicate).
        calls: ``(ridge families, LDA families, scorings)``: each has a fixed cost (its folds'
            bookkeeping, validation errors, tables) that dominates at small width.
    """

    paths: float = 0.0
    solves: float = 0.0
    flops: float = 0.0
    scored: float = 0.0
    calls: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True)
class FitRates:
    """Seconds per unit of :class:`FitWork`, measured on the machine and device that will fit: per
    d^3 of a penalty path and of a Cholesky solve, per flop of a matrix product, per sample scored,
    and the fixed seconds of a ridge family, an LDA family and a scoring (``call``).

    Example:
        >>> rates = FitRates(path=1e-10, solve=2e-11, flop=2e-11, score=1e-6, call=(1e-3, 1e-4, 1e-2))
        >>> round(rates.seconds(FitWork(paths=512**3 * 10, flops=1e9, scored=16384, calls=(10, 0, 1))), 3)
        0.191
    """

    path: float
    solve: float
    flop: float
    score: float
    call: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def seconds(self, work: FitWork) -> float:
        """Estimated seconds of ``work``."""
        fixed = sum(n * seconds for n, seconds in zip(work.calls, self.call))
        return (
            work.paths * self.path
            + work.solves * self.solve
            + work.flops * self.flop
            + work.scored * self.score
            + fixed
        )
