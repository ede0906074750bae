"""A thread at the OS's idle CPU priority for the engine's bulk-only steps while chat is
served (`EngineConfig.bulk_idle_priority_s`; `engine.async_engine.AsyncEngine` decides which
steps go here)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


class IdleRunner:
    """Runs calls, one at a time, on a thread of its own at the lowest CPU priority it can
    get without privilege (Linux's SCHED_IDLE: it runs only on a CPU nothing else wants; else
    niceness 19): the engine thread hands it the bulk-only steps that should yield the CPU,
    and waits for each.

    Why: on a host whose cores are busy, every process on a chat's way (ingress, Serve's
    handoff, the replica's event loop) waits for a CPU the bulk steps hold; a thread at normal
    priority that wakes there preempts an idle-priority one at once. An unprivileged thread
    can lower its priority but never raise it back, hence a thread of its own. The priority is
    a hint to the OS scheduler, not a lock: with CPUs free it changes nothing.

    `hurry` (a chat arrived: the step in progress is to stop at its next layer) lifts the
    thread to normal priority until its next call, where the process may (CAP_SYS_NICE, e.g.
    root): else a starved idle thread would reach the layer boundary only when a core frees."""

    def __init__(self) -> None:
        self.priority = ""
        self._tid = 0
        self._lifted = False
        self._can_lift = True
        self._normal_nice = 0  # the thread's niceness before it was lowered
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="firstlight-engine-idle", initializer=self._start
        )

    def _start(self) -> None:
        self._tid = threading.get_native_id()
        self._lower()
        logger.info("bulk steps that yield to chat run at %s", self.priority)

    def _lower(self) -> None:
        """Put this (the runner's) thread at the lowest priority; per thread on Linux only
        (elsewhere both calls would lower the whole process: it stays as it is)."""
        if not sys.platform.startswith("linux"):
            self.priority = "normal priority (per-thread priorities are Linux's)"
            return
        self._normal_nice = os.getpriority(os.PRIO_PROCESS, 0)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            self.priority = "SCHED_IDLE"
            return
        except (AttributeError, OSError):
            pass
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
            self.priority = "nice 19"
        except (AttributeError, OSError):
            self.priority = "normal priority (no lower one allowed)"

    def hurry(self) -> None:
        """Lift the runner's thread to normal priority until its next call (any thread may
        call this; a no-op where the process may not raise a thread's priority)."""
        if not self._can_lift or not self._tid or self._lifted:
            return
        try:
            if self.priority == "SCHED_IDLE":
                os.sched_setscheduler(self._tid, os.SCHED_OTHER, os.sched_param(0))
            elif self.priority == "nice 19":
                os.setpriority(os.PRIO_PROCESS, self._tid, self._normal_nice)
            else:
                return
        except PermissionError:
            self._can_lift = False  # unprivileged: the idle thread finishes its layer as is
            return
        except OSError:  # the thread is gone (shut down)
            return
        self._lifted = True

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self._lifted:
            self._lifted = False
            self._lower()
        return fn(*args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._pool.submit(self._call, fn, args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
