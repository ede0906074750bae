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
seats; one serving interactive requests, or that served some within `hold_s` (chats are
short, so a snapshot that shows none does not mean the chat load has stopped), lends at most
`busy_share` of its seats, and never a seat interactive requests hold. At least one bulk
request may always run, so bulk always moves.

`unlimited`: no throttle (bulk is bounded only by each engine's own admission).
"""

from __future__ import annotations

import time
from abc import abstractmethod
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


def bulk_room(throttle: BulkThrottle, replicas: Mapping[str, EngineStats], own: int) -> int:
    """How many more bulk requests one caller with `own` bulk requests in flight may send:
    the allowance, less the bulk other callers have in the engines (all bulk there, as last
    reported, less this caller's own), less its own."""
    others = max(0, bulk_in_engines(replicas) - own)
    return throttle.allowance(replicas) - others - own


@register("spare_capacity")
class SpareCapacity(BulkThrottle):
    def __init__(
        self,
        busy_share: float = 0.125,
        hold_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= busy_share <= 1.0:
            raise ValueError("spare_capacity: busy_share must be in [0, 1]")
        if hold_s < 0.0:
            raise ValueError("spare_capacity: hold_s must be >= 0")
        self.busy_share = busy_share
        self.hold_s = hold_s
        self._clock = clock
        self._last_interactive: dict[str, float] = {}  # replica id → when last seen serving

    def allowances(self, replicas: Mapping[str, EngineStats]) -> dict[str, int]:
        now = self._clock()
        seen = self._last_interactive
        for rid in [rid for rid in seen if rid not in replicas]:
            del seen[rid]
        out: dict[str, int] = {}
        for rid, stats in replicas.items():
            seats = stats.admission.max_running
            interactive = stats.running.interactive + stats.waiting.interactive
            if interactive:
                seen[rid] = now
            if interactive == 0 and now - seen.get(rid, float("-inf")) >= self.hold_s:
                out[rid] = seats
            else:
                out[rid] = max(0, min(seats - interactive, int(seats * self.busy_share)))
        return out


@register("unlimited")
class Unlimited(BulkThrottle):
    def allowances(self, replicas: Mapping[str, EngineStats]) -> dict[str, int]:
        return dict.fromkeys(replicas, UNLIMITED)

    def allowance(self, replicas: Mapping[str, EngineStats]) -> int:
        return UNLIMITED
