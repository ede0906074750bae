"""How many bulk requests the cluster may have in its engines now.

Bulk work (batch lines, `service_tier: flex` requests) should fill the capacity interactive
traffic leaves, and no more: every bulk sequence in a replica's step lengthens the step
every interactive token on that replica waits for. A caller that sends bulk requests (an
ingress, the batch runner) asks the policy for the cluster's allowance from the control
plane's view of the replicas (per replica: its engine stats, up to a sync period old), and
holds its bulk requests while the bulk already in the engines fills it (actors/bulk_gate.py).

The allowance is per replica (`allowances`), so class-aware routing can send bulk only where
seats are lent, and summed for the cluster (`allowance`).

`spare_capacity` (the default): a replica with no interactive request lends bulk all its
seats, and `queue_ahead` of them more to wait in its queue (a seat that frees is then
refilled by the engine's next step, not after a round trip to the caller, and callers can
send bulk in bunches); one serving interactive requests, or that took some in within
`hold_s` (chats are short, so a snapshot that shows none running does not mean the chat
load has stopped: the replica's count of interactive requests taken in tells), lends at
most `busy_share` of its seats, none to queue, and never a seat interactive requests hold.
At least one bulk request may always run, so bulk always moves.

`unlimited`: no throttle (bulk is bounded only by each engine's own admission).
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Mapping

from engine.stats import EngineStats
from policies.base import Policy, register

UNLIMITED = 1 << 30


class BulkThrottle(Policy, family=True):
    @abstractmethod
    def allowances(self, replicas: Mapping[str, EngineStats]) -> dict[str, int]:
        """Per replica (replica id → its latest stats): the bulk requests (running +
        waiting) its engine may hold now, all callers together."""

    def allowance(self, replicas: Mapping[str, EngineStats]) -> int:
        """The cluster's: the replicas' allowances together, at least 1 (bulk always moves)."""
        return max(1, sum(self.allowances(replicas).values()))


def bulk_in_engines(replicas: Mapping[str, EngineStats]) -> int:
    """Bulk requests running or waiting in `replicas`, as last reported."""
    return sum(s.running.bulk + s.waiting.bulk for s in replicas.values())


def bulk_room(
    throttle: BulkThrottle,
    replicas: Mapping[str, EngineStats],
    own: int,
    own_reported: int | None = None,
) -> int:
    """How many more bulk requests one caller with `own` bulk requests in flight may send:
    the allowance, less the bulk other callers have in the engines, less its own.

    Other callers' bulk is all the bulk the engines last reported less what of it was this
    caller's: `own_reported`, its in-flight count when those reports were made (pass the
    most it had in flight over the view's age: reports lag, and subtracting only what is in
    flight *now* would count this caller's just-finished requests as someone else's and
    leave their places empty until the next report)."""
    reported = own if own_reported is None else max(own, own_reported)
    others = max(0, bulk_in_engines(replicas) - reported)
    return throttle.allowance(replicas) - others - own


class RecentMax:
    """The largest value `note`d over the last `window_s` seconds (e.g. a caller's bulk in
    flight over the age of its cluster view)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque()  # (time, value), values decreasing

    def note(self, value: int) -> int:
        """Record `value` now; returns the max over the window."""
        now = self.clock()
        samples = self._samples
        while samples and samples[-1][1] <= value:
            samples.pop()
        samples.append((now, value))
        while samples[0][0] < now - self.window_s:
            samples.popleft()
        return samples[0][1]


@register("spare_capacity")
class SpareCapacity(BulkThrottle):
    def __init__(
        self,
        busy_share: float = 0.125,
        hold_s: float = 5.0,
        queue_ahead: float = 0.125,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= busy_share <= 1.0:
            raise ValueError("spare_capacity: busy_share must be in [0, 1]")
        if hold_s < 0.0:
            raise ValueError("spare_capacity: hold_s must be >= 0")
        if not 0.0 <= queue_ahead <= 1.0:
            raise ValueError("spare_capacity: queue_ahead must be in [0, 1]")
        self.busy_share = busy_share
        self.hold_s = hold_s
        self.queue_ahead = queue_ahead
        self._clock = clock
        self._last_interactive: dict[str, float] = {}  # replica id → when last seen serving
        self._taken: dict[str, int] = {}  # replica id → its interactive requests taken in

    def allowances(self, replicas: Mapping[str, EngineStats]) -> dict[str, int]:
        now = self._clock()
        seen = self._last_interactive
        taken = self._taken
        for rid in [rid for rid in taken if rid not in replicas]:
            seen.pop(rid, None)
            del taken[rid]
        out: dict[str, int] = {}
        for rid, stats in replicas.items():
            seats = stats.admission.max_running
            interactive = stats.running.interactive + stats.waiting.interactive
            count = stats.num_requests.interactive
            if interactive or taken.get(rid, count) != count:
                seen[rid] = now
            taken[rid] = count
            if interactive == 0 and now - seen.get(rid, float("-inf")) >= self.hold_s:
                out[rid] = seats + math.ceil(seats * self.queue_ahead)
            else:
                out[rid] = max(0, min(seats - interactive, int(seats * self.busy_share)))
        return out


@register("unlimited")
class Unlimited(BulkThrottle):
    def allowances(self, replicas: Mapping[str, EngineStats]) -> dict[str, int]:
        return dict.fromkeys(replicas, UNLIMITED)

    def allowance(self, replicas: Mapping[str, EngineStats]) -> int:
        return UNLIMITED
