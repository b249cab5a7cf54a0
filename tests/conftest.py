"""Shared fixtures."""

import pytest

from nopelens.models import threads


@pytest.fixture
def one_thread():
    """Run a test with torch and BLAS on one thread: tiny models gain nothing from more, and on a
    loaded 2-core machine two threads preempting each other made the training tests 20x slower."""
    with threads.one_thread():
        yield
