"""Where a caller holds its bulk requests until the cluster has spare capacity for them.

Every caller of the model replicas (each ingress, the batch runner) has one gate. A bulk
request passes when the bulk this caller has in flight, plus the bulk other callers have in
the engines (the control plane's view less this caller's own), is below the cluster's
allowance (`policies.bulk_throttle`); otherwise it waits, in arrival order, re-checking when
one of this caller's bulk requests ends and every `poll_s` (the view refreshes every sync
period). A request that waits longer than `max_wait_s`, or finds `max_waiting` others
already waiting, is refused at once with 429 and the engine's Retry-After. Interactive
requests never wait here.

Plain asyncio, one event loop (no Ray), so it is tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping

from app.metric_snapshot import Snapshot, unlabelled
from engine.errors import QueueFull
from engine.request import RequestClass
from engine.stats import EngineStats
from policies.bulk_throttle import BulkThrottle, RecentMax, bulk_room


class BulkGate:
    def __init__(
        self,
        throttle: BulkThrottle,
        replicas: Callable[[], Mapping[str, EngineStats]],
        *,
        max_wait_s: float,
        max_waiting: int,
        retry_after: Callable[[RequestClass], float] = lambda _: 1.0,
        poll_s: float = 0.05,
        view_age_s: float = 2.0,
    ) -> None:
        self.throttle = throttle
        self.replicas = replicas
        self.max_wait_s = max_wait_s
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.poll_s = poll_s
        self.in_flight = 0  # this caller's bulk requests past the gate, not yet ended
        # the most it had in flight while the view's reports were made (bulk_room)
        self._reported = RecentMax(view_age_s)
        self._waiting: deque[asyncio.Event] = deque()  # one per waiting request, in order
        self.num_waited = 0  # requests that had to wait (cumulative)
        self.num_refused = 0

    def snapshot(self) -> Snapshot:
        """The gate as metric families (in the caller's `/metrics`)."""
        return {
            "firstlight_bulk_gate_in_flight": unlabelled(
                "gauge", "Bulk requests past the gate, not yet ended.", self.in_flight
            ),
            "firstlight_bulk_gate_waiting": unlabelled(
                "gauge", "Bulk requests waiting for spare capacity.", len(self._waiting)
            ),
            "firstlight_bulk_gate_waited": unlabelled(
                "counter", "Bulk requests that had to wait for spare capacity.", self.num_waited
            ),
            "firstlight_bulk_gate_refused": unlabelled(
                "counter", "Bulk requests refused (429) for want of spare capacity.",
                self.num_refused,
            ),
        }  # fmt: skip

    def room(self) -> int:
        """How many more bulk requests this caller may send now."""
        view = self.replicas()
        if not view:
            return max(0, 1 - self.in_flight)  # no view yet: one at a time
        reported = self._reported.note(self.in_flight)
        return bulk_room(self.throttle, view, self.in_flight, reported)

    async def acquire(self, request_class: RequestClass) -> bool:
        """Wait for room for one request of `request_class`; True when it took a bulk place
        (give it back with `release`). Raises `QueueFull` past the wait bounds."""
        if request_class is not RequestClass.BULK:
            return False
        if not self._waiting and self.room() > 0:
            self.in_flight += 1
            self._reported.note(self.in_flight)
            return True
        if len(self._waiting) >= self.max_waiting:
            self.num_refused += 1
            raise QueueFull(
                f"no spare capacity for bulk requests ({self.max_waiting} already waiting)",
                retry_after_s=self.retry_after(request_class),
            )
        self.num_waited += 1
        wake = asyncio.Event()
        self._waiting.append(wake)
        deadline = time.monotonic() + self.max_wait_s
        try:
            while True:
                wake.clear()
                if self._waiting[0] is wake and self.room() > 0:
                    self.in_flight += 1
                    self._reported.note(self.in_flight)
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    self.num_refused += 1
                    raise QueueFull(
                        f"no spare capacity for bulk requests within {self.max_wait_s:g} s",
                        retry_after_s=self.retry_after(request_class),
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), min(self.poll_s, left))
        finally:
            self._waiting.remove(wake)
            if self._waiting:
                self._waiting[0].set()  # the next in line re-checks now

    def release(self) -> None:
        """A bulk request that `acquire` let through has ended."""
        self.in_flight -= 1
        if self._waiting:
            self._waiting[0].set()
