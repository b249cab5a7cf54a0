"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread: tiny models gain nothing from more, and on a loaded
    2-core machine two threads preempting each other made the training tests 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
