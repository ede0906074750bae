"""Class-aware routing: replicas kept free of bulk work for interactive requests.

An interactive token waits for its replica's whole step, and every bulk prefill chunk and
bulk sequence in that step lengthens it. `class_pools` keeps `interactive_replicas`
replicas out of bulk's way (never all of them: with two or more replicas, bulk keeps at
least one; a single replica serves both classes). The other replicas form the second pool,
which is either

    shared   bulk requests go there; interactive ones may go to any replica
    bulk     bulk requests only; interactive ones stay in the interactive pool

Within the replicas a request may use, the `inner` policy ranks (prefix affinity by
default, with its own options): a conversation still returns to the replica holding its
history, and a new prompt goes to the least loaded, which for chat is an interactive
replica whenever bulk keeps the shared ones busy.

An interactive replica may lend bulk its seats, as the bulk throttle (`policies.bulk_throttle`,
the same policy the callers hold bulk with) reckons them: `lend: idle` (the default) only
while it serves no chat (all its seats, none once chat was seen within the throttle's hold),
so a fleet running only bulk work uses every replica and chat finds its pool free of new
bulk; `lend: throttle` also the small share the throttle lends a replica serving chat;
`lend: off` never. What each replica carries comes from the router's `PrefixIndex.loads`;
before the first report, nothing is lent.

Membership is sticky: a replica stays in the interactive pool while it lives (its cache holds
the interactive prefixes); a vacancy is filled by the lowest replica id of the other pool, so
routers that saw the same replicas come and go agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from engine.request import Request, RequestClass
from policies.base import create, register
from policies.bulk_throttle import BulkThrottle
from policies.prefix_index import PrefixIndex
from policies.routing import Candidate, ReplicaRoutingPolicy


@register("class_pools")
class ClassPools(ReplicaRoutingPolicy):
    def __init__(
        self,
        interactive_replicas: int = 1,
        other_pool: Literal["shared", "bulk"] = "shared",
        inner: str = "prefix_affinity",
        lend: Literal["idle", "throttle", "off"] = "idle",
        throttle: str = "spare_capacity",
        throttle_options: dict[str, Any] | None = None,
        **inner_options: Any,
    ) -> None:
        if interactive_replicas < 1:
            raise ValueError("class_pools: interactive_replicas must be at least 1")
        if other_pool not in ("shared", "bulk"):
            raise ValueError(f"class_pools: other_pool must be shared or bulk, got {other_pool!r}")
        if inner == self.name:
            raise ValueError("class_pools: inner must be another routing policy")
        if lend not in ("idle", "throttle", "off"):
            raise ValueError(f"class_pools: lend must be idle, throttle or off, got {lend!r}")
        self.interactive_replicas = interactive_replicas
        self.other_pool = other_pool
        self.inner = create(ReplicaRoutingPolicy, inner, **inner_options)
        self.lend = lend
        self.throttle = create(BulkThrottle, throttle, **(throttle_options or {}))
        self.index: PrefixIndex | None = None
        self._pool: list[str] = []  # the interactive pool, in joining order

    def pools(self, replica_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        """(interactive pool, other pool) over the live `replica_ids`."""
        live = set(replica_ids)
        self._pool = [rid for rid in self._pool if rid in live]
        size = min(self.interactive_replicas, len(live) - 1)
        if size <= 0:  # one replica (or none): it serves both classes
            return sorted(live), sorted(live)
        del self._pool[size:]
        for rid in sorted(live):
            if len(self._pool) >= size:
                break
            if rid not in self._pool:
                self._pool.append(rid)
        members = set(self._pool)
        return list(self._pool), sorted(live - members)

    def rank(self, request: Request | None, replicas: Sequence[Candidate]) -> list[list[str]]:
        interactive, other = self.pools([r.replica_id for r in replicas])
        by_id = {r.replica_id: r for r in replicas}

        def ranks(ids: list[str]) -> list[list[str]]:
            return self.inner.rank(request, [by_id[rid] for rid in ids]) if ids else []

        if other == interactive:  # one replica serves both classes
            return ranks(interactive)
        if request is not None and request.request_class is RequestClass.BULK:
            return ranks(other + self.lending(interactive))
        if self.other_pool == "shared":
            return ranks(interactive + other)
        return ranks(interactive)

    def lending(self, pool: list[str]) -> list[str]:
        """The replicas of the interactive `pool` with a lent bulk seat free, as last reported."""
        if self.lend == "off" or self.index is None:
            return []
        loads = {rid: self.index.loads[rid] for rid in pool if rid in self.index.loads}
        allowed = self.throttle.allowances(loads)
        if self.lend == "idle":  # a replica lends only when the throttle sees it idle
            allowed = {
                rid: n if n >= loads[rid].admission.max_running else 0 for rid, n in allowed.items()
            }
        return [
            rid
            for rid, stats in loads.items()
            if stats.running.bulk + stats.waiting.bulk < allowed.get(rid, 0)
        ]

    def routed(self, request: Request | None, replica_id: str) -> None:
        self.inner.routed(request, replica_id)

    def forget(self, live_replica_ids: set[str]) -> None:
        self.inner.forget(live_replica_ids)

    def use_index(self, index: PrefixIndex) -> None:
        self.index = index
        self.inner.use_index(index)
