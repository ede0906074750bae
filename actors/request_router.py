"""A `policies.routing` policy as Ray Serve's request router for the ModelReplica deployment.

Serve builds one router per caller process (each ingress) from the deployment's
`request_router_config` (see `actors/builder.py`) and calls `choose_replicas` for every
request with the live replicas; this adapter hands the policy the request (the engine
`Request`, the first argument of every token-path call) and the queue lengths Serve's router
already tracks, and maps the policy's ranks back to Serve's replica objects. Serve then probes
the replicas of the first rank and sends the request to the least loaded one that accepts.

Unlike Serve's default router this one has no FIFO mixin: the replica chosen for a request
serves that request, not whichever request happens to be first in the queue.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.serve_internals import replica_queue_lengths
from engine.request import Request
from policies.base import create
from policies.routing import Candidate, ReplicaRoutingPolicy


def request_of(pending: PendingRequest | None) -> Request | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, Request):
            return arg
    return None


class PolicyRequestRouter(RequestRouter):
    """`request_router_kwargs`: `policy` (a registered `ReplicaRoutingPolicy` name) and the
    policy's own options."""

    policy: ReplicaRoutingPolicy

    def initialize_state(self, policy: str = "prefix_affinity", **options: Any) -> None:
        self.policy = create(ReplicaRoutingPolicy, policy, **options)
        self._known: frozenset[str] = frozenset()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        live = frozenset(by_id)
        if live != self._known:
            self.policy.forget(set(live))
            self._known = live
        queue_len = replica_queue_lengths(self)
        views = [Candidate(uid, queue_len(r.replica_id)) for uid, r in by_id.items()]
        ranks = self.policy.rank(request_of(pending_request), views)
        return [[by_id[uid] for uid in rank if uid in by_id] for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self.policy.routed(request_of(pending_request), replica_id.unique_id)
