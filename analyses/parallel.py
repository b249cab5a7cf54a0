"""Where a sweep's tasks run: in this process, in local worker processes, or on a Dask cluster.

A sweep is embarrassingly parallel per (model, training seed). :func:`run_tasks` hands each task
to an existing engine and gives every result back to the caller *as it finishes*, so the caller
can write it into the run folder at once: a task that finished is never measured again, and a
worker lost mid-task loses only its own tasks (a rerun measures just those).

- ``jobs=1``, no scheduler: a plain loop in this process (progress bars shown);
- ``jobs=N``: :class:`concurrent.futures.ProcessPoolExecutor` with ``N`` workers (a sweep task
  runs on one thread, :func:`nopelens.models.threads.one_thread`, so N workers share N cores
  without oversubscribing them). On Linux the workers are forked from this process, so they start
  at once with its imports (the imports cost seconds, as much as measuring a small model);
  elsewhere they are spawned. Their progress bars write timed lines (they share a terminal);
- ``scheduler=ADDRESS``: a Dask ``distributed`` cluster through its ``concurrent.futures``
  executor (``Client(ADDRESS).get_executor()``; ``pip install "nopelens[dask]"``). Workers need
  nopelens installed; a worker reads zoo models from its own cache (``$NOPELENS_CACHE``) and
  trains into it what it lacks.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, Sequence

from nopelens.models.progress import lines_only

WORKER_LOST = ("BrokenProcessPool", "KilledWorker", "CommClosedError", "FutureCancelledError", "CancelledError")
"""Exception class names that mean "the worker went away", not "the measurement failed"."""


def run_tasks(
    function: Callable[..., Any],
    tasks: Sequence[tuple[Hashable, tuple]],
    on_done: Callable[[Hashable, Any], None],
    jobs: int = 1,
    scheduler: str | None = None,
) -> None:
    """Run ``function(*args)`` for every ``(key, args)`` in ``tasks``; call ``on_done(key, result)``
    in this process as each one finishes (in finishing order).

    Args:
        function: a module-level (picklable) function.
        tasks: ``(key, args)`` pairs; ``args`` must pickle.
        on_done: receives each result; runs in the calling process, one at a time.
        jobs: local worker processes (1: run in this process).
        scheduler: address of a Dask scheduler (``tcp://host:8786``); overrides ``jobs``.

    Raises:
        ValueError: if ``jobs`` < 1.
        ValueError: if ``scheduler`` is given and ``distributed`` is not installed.
        ChildProcessError: if workers were lost; every task that finished has been passed to
            ``on_done`` first, so a rerun measures only what is missing.
        Exception: the first exception a task raised, after every other task was run and passed on.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    jobs = min(jobs, len(tasks))
    if scheduler is None and jobs <= 1:
        for key, args in tasks:
            on_done(key, function(*args))
        return
    failures = []
    with _executor(jobs, scheduler) as executor:
        futures = {executor.submit(function, *args): key for key, args in tasks}
        try:
            for future in cf.as_completed(futures):
                key = futures[future]
                try:
                    result = future.result()
                except Exception as error:  # noqa: BLE001 - raised below, once the other tasks are in
                    failures.append((key, error))
                    continue
                on_done(key, result)
        except BaseException:  # an interrupt: drop what has not started instead of waiting for it
            for future in futures:
                future.cancel()
            executor.shutdown(wait=False)
            raise
    _raise_failures(failures, len(tasks))


@contextmanager
def _executor(jobs: int, scheduler: str | None) -> Iterator[cf.Executor]:
    if scheduler is None:
        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        # workers share this terminal: their progress bars write lines instead of redrawing
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=lines_only) as pool:
            yield pool
        return
    try:
        from distributed import Client
    except ImportError:
        raise ValueError('--scheduler needs Dask distributed, which is not installed: pip install "nopelens[dask]"') from None
    try:
        client = Client(scheduler, timeout="30s")
    except OSError as error:
        raise OSError(f"cannot reach the Dask scheduler at {scheduler}: {error}") from None
    try:
        # pure=False: the same arguments on a rerun must run again, not return a cached key
        yield client.get_executor(pure=False)
    finally:
        client.close()


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity), the default number of local workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _raise_failures(failures: list[tuple[Hashable, BaseException]], n_tasks: int) -> None:
    if not failures:
        return
    lost = [(key, error) for key, error in failures if type(error).__name__ in WORKER_LOST]
    if len(lost) < len(failures):
        raise next(error for _, error in failures if type(error).__name__ not in WORKER_LOST)
    names = ", ".join(str(key) for key, _ in lost)
    raise ChildProcessError(
        f"{len(lost)} of {n_tasks} tasks did not finish because a worker was lost ({names}); "
        "the finished ones are saved, rerun the same command to measure the rest"
    )
