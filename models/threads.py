"""One thread for torch and the BLAS libraries while nopelens measures.

The probes, sweeps and checks run many small matrix products; a second thread gains little on
them and, on a machine whose cores are busy, can make them many times slower (spinning OpenMP and
BLAS threads). One thread also makes the numbers independent of the core count, and of how many
sweep workers share the machine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch and the BLAS libraries (through threadpoolctl) on one thread inside the block."""
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(before)
