"""The one admission decision: admit a request to the waiting queue, or refuse it with
`QueueFull(retry_after_s)` (429 + Retry-After). Every layer that may refuse asks this module.

Class rule (the waiting queue holds at most `max_waiting` requests):

    interactive   admitted while the whole queue has a free place
    bulk          admitted while more than `interactive_reserve` places are free

so a flood of bulk requests never takes the last `interactive_reserve` places: an interactive
request is refused only when the queue is full, whatever the bulk load. Running requests are
not bounded here (the step scheduler's `max_num_seqs` bounds them).

Retry-After: how long the requests ahead of the refused one take to drain at the measured
drain rate (finishes per second over the last `window_s`), clamped to
[`min_retry_after_s`, `max_retry_after_s`]. Ahead of an interactive request are the waiting
interactive ones (interactive is scheduled first); ahead of a bulk request, every waiting one;
at least one request must leave in any case (a refused request found the queue full).
Before two finishes were seen in the window, it is `min_retry_after_s`.

Plain Python with an injected clock; not thread-safe (the AsyncEngine uses it on its event
loop only).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from engine.errors import QueueFull
from engine.request import RequestClass
from engine.stats import AdmissionStats, ClassCounts

DEFAULT_RESERVE_FRACTION = 0.25  # of max_waiting, when no interactive_reserve is given
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def default_interactive_reserve(max_waiting: int) -> int:
    """A quarter of the queue, but bulk keeps at least one place (`max_waiting` >= 2)."""
    return min(max_waiting - 1, math.ceil(max_waiting * DEFAULT_RESERVE_FRACTION))


def has_room(
    request_class: RequestClass, waiting: ClassCounts, max_waiting: int, interactive_reserve: int
) -> bool:
    """Whether a request of `request_class` may join a queue holding `waiting`."""
    limit = (
        max_waiting
        if request_class is RequestClass.INTERACTIVE
        else max_waiting - interactive_reserve
    )
    return waiting.total < limit


def requests_ahead(request_class: RequestClass, waiting: ClassCounts) -> int:
    """Waiting requests that would be scheduled before a new one of `request_class`."""
    return waiting.interactive if request_class is RequestClass.INTERACTIVE else waiting.total


def retry_after_s(
    ahead: int,
    drain_rate_per_s: float | None,
    lo: float = MIN_RETRY_AFTER_S,
    hi: float = MAX_RETRY_AFTER_S,
) -> float:
    """`ahead` requests (at least one) at `drain_rate_per_s` finishes per second, clamped to
    [lo, hi]; `lo` while the rate is unknown."""
    if not drain_rate_per_s or drain_rate_per_s <= 0.0:
        return lo
    return min(hi, max(lo, max(1, ahead) / drain_rate_per_s))


class DrainMeter:
    """Finishes per second over the last `window_s` seconds (at most `max_samples` kept).

    Rate = (n - 1) / (now - oldest) over the n finishes in the window: exact for evenly
    spaced finishes observed at the last one, and decaying while nothing finishes."""

    def __init__(
        self,
        window_s: float = 10.0,
        max_samples: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0.0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.clock = clock
        self._times: deque[float] = deque(maxlen=max_samples)

    def record(self, n: int = 1) -> None:
        """`n` requests left the engine now (finished, aborted or failed)."""
        now = self.clock()
        for _ in range(n):
            self._times.append(now)

    def rate_per_s(self) -> float | None:
        now = self.clock()
        times = self._times
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) < 2:
            return None
        span = now - times[0]
        return (len(times) - 1) / span if span > 0.0 else None


class Admission:
    """The decision for one engine's waiting queue (see the module docstring for the rule)."""

    def __init__(
        self,
        max_waiting: int,
        *,
        interactive_reserve: int | None = None,
        window_s: float = 10.0,
        min_retry_after_s: float = MIN_RETRY_AFTER_S,
        max_retry_after_s: float = MAX_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_waiting < 1:
            raise ValueError("max_waiting must be at least 1")
        reserve = (
            default_interactive_reserve(max_waiting)
            if interactive_reserve is None
            else interactive_reserve
        )
        if not 0 <= reserve < max_waiting:
            raise ValueError("interactive_reserve must be in [0, max_waiting)")
        if not 0.0 < min_retry_after_s <= max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s")
        self.max_waiting = max_waiting
        self.interactive_reserve = reserve
        self.min_retry_after_s = min_retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self.drain = DrainMeter(window_s, clock=clock)

    def check(self, request_class: RequestClass, waiting: ClassCounts) -> None:
        """Return if a request of `request_class` may join `waiting`; else raise QueueFull
        carrying `retry_after_s(request_class, waiting)`."""
        if has_room(request_class, waiting, self.max_waiting, self.interactive_reserve):
            return
        retry = self.retry_after_s(request_class, waiting)
        if request_class is RequestClass.INTERACTIVE:
            message = f"the waiting queue is full ({self.max_waiting} requests)"
        else:
            message = (
                f"the waiting queue has no room for bulk requests "
                f"({self.interactive_reserve} of {self.max_waiting} places are kept for "
                f"interactive ones)"
            )
        raise QueueFull(message, retry_after_s=retry)

    def retry_after_s(self, request_class: RequestClass, waiting: ClassCounts) -> float:
        return retry_after_s(
            requests_ahead(request_class, waiting),
            self.drain.rate_per_s(),
            self.min_retry_after_s,
            self.max_retry_after_s,
        )

    def record_finished(self, n: int = 1) -> None:
        self.drain.record(n)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            max_waiting=self.max_waiting,
            interactive_reserve=self.interactive_reserve,
            drain_rate_per_s=self.drain.rate_per_s(),
        )
