"""Suite-wide fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The suite runs tiny models: their matmuls gain nothing from threads, and lose badly
    (OpenMP threads waiting on each other) on a shared 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
