"""Fixtures of the tuning tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """torch at one intra-op thread for the test: its thread pool spins against other processes
    on a busy small machine and turns a ~1 ms step into tens of ms, where these tests need
    "model step ~0 ms" to hold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
