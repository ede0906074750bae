"""Suite-wide fixtures, and how the test process ends."""

from __future__ import annotations

import atexit
import logging
import os
import sys

import pytest
import torch

# The session's exit status, once pytest has reported it (see `_skip_teardown`).
_exit_status: int | None = None


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The suite runs tiny models: their matmuls gain nothing from threads, and lose badly
    (OpenMP threads waiting on each other) on a shared 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def _skip_teardown() -> None:
    """Ends the test process once pytest has reported, before the interpreter frees its
    modules. transformers imports triton in a whole-suite run, and freeing triton's
    extension module at interpreter exit sometimes crashes the process (a segfault after
    nanobind's "leaked instances" report: CI saw exit 2 after every test had passed). Nothing
    the tests check happens in that teardown; `atexit` runs this after the handlers
    registered later (Ray's included) and after non-daemon threads were joined."""
    if _exit_status is None:  # pytest did not get as far as a result: exit the usual way
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


# Registered at import, before anything a test starts, so it runs after their handlers.
atexit.register(_skip_teardown)
