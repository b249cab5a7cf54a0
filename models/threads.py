"""One thread for torch and the BLAS libraries while nopelens measures and trains.

The probes, sweeps and checks run many small matrix products; a second thread gains little on
them and, on a machine whose cores are busy, can make them many times slower (spinning OpenMP and
BLAS threads). One thread also makes the numbers independent of the core count, and of how many
sweep workers share the machine; training, whose weights depend on the thread count (reductions
split differently), records its count in the recipe (:func:`~nopelens.models.training.train`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from threadpoolctl import threadpool_limits


@contextlib.contextmanager
def limited_threads(threads: int) -> Iterator[None]:
    """torch and the BLAS libraries (through threadpoolctl) on ``threads`` threads inside the block.

    Raises:
        ValueError: if ``threads`` is not an integer >= 1.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(limits=threads):
            yield
    finally:
        torch.set_num_threads(before)


def one_thread():
    """torch and the BLAS libraries on one thread inside the block (:func:`limited_threads`)."""
    return limited_threads(1)
