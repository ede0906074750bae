"""A `policies.routing` policy as Ray Serve's request router for the ModelReplica deployment.

Serve builds one router per caller process (each ingress) from the deployment's
`request_router_config` (see `actors/builder.py`) and calls `choose_replicas` for every
request with the live replicas; this adapter hands the policy the request (the engine
`Request`, the first argument of every token-path call; a group call's first request) and
the queue lengths Serve's router already tracks, and maps the policy's ranks back to Serve's
replica objects. Serve then probes the replicas of the first rank and sends the request to
the least loaded one that accepts.

Unlike Serve's default router this one has no FIFO mixin: the replica chosen for a request
serves that request, not whichever request happens to be first in the queue.

What the replicas' prefix caches hold reaches the policy through this router's own
`PrefixIndex`, kept current by a background task that asks the control plane for the sketch
diffs it has not seen every `sketch_sync_s`, on a thread of its own (started with the first
request routed; routing itself never waits for it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from actors.runtime import deployment_name
from actors.serve_internals import replica_queue_lengths, router_app_name
from engine.request import Request
from policies.base import create
from policies.prefix_index import PrefixIndex
from policies.routing import Candidate, ReplicaRoutingPolicy

logger = logging.getLogger("firstlight.routing")


def requests_of(pending: PendingRequest | None) -> list[Request]:
    """The engine requests a call carries: its `Request` argument, or the list of a group
    (`ModelReplica.stream_group`)."""
    if pending is None:
        return []
    for arg in pending.args:
        if isinstance(arg, Request):
            return [arg]
        if isinstance(arg, list) and arg and isinstance(arg[0], Request):
            return arg
    return []


def request_of(pending: PendingRequest | None) -> Request | None:
    """The request to route by (a group goes where its first request would)."""
    requests = requests_of(pending)
    return requests[0] if requests else None


class PolicyRequestRouter(RequestRouter):
    """`request_router_kwargs`: `policy` (a registered `ReplicaRoutingPolicy` name) and the
    policy's own options; `control_plane` (the ControlPlane deployment's name; None: no
    sketches), `model` (whose replicas' sketches to follow) and `sketch_sync_s`."""

    policy: ReplicaRoutingPolicy

    def initialize_state(
        self,
        policy: str = "prefix_affinity",
        control_plane: str | None = None,
        model: str = "",
        sketch_sync_s: float = 0.5,
        **options: Any,
    ) -> None:
        self.policy = create(ReplicaRoutingPolicy, policy, **options)
        self.index = PrefixIndex()
        self.policy.use_index(self.index)
        self._known: frozenset[str] = frozenset()
        self._control_plane = control_plane
        self._model = model
        self._sketch_sync_s = sketch_sync_s
        self._follower: threading.Thread | None = None

    def _follow_sketches(self, control_plane: str, loop: asyncio.AbstractEventLoop) -> None:
        """Keep `index` current, on a thread of its own: a Serve handle cannot be created on
        the loop routers run on when Serve runs them on a loop of their own (it waits for
        that loop). Updates are applied on the router's loop, so the index is only ever
        touched there; a failed sync leaves it as it was (routing goes on)."""
        app = router_app_name(self) or deployment_name()[0]
        timeout_s = max(1.0, 4 * self._sketch_sync_s)
        handle = None
        while True:
            try:
                if handle is None:
                    handle = serve.get_deployment_handle(control_plane, app_name=app)
                have = asyncio.run_coroutine_threadsafe(self._have(), loop).result(timeout_s)
                sync = handle.router_sync.remote(have, self._model).result(timeout_s=timeout_s)
                loop.call_soon_threadsafe(
                    self.index.apply, sync.updates, sync.live, time.monotonic(), sync.stats
                )
            except Exception as exc:
                logger.debug("prefix sketch sync failed: %r", exc)
            time.sleep(self._sketch_sync_s)

    async def _have(self) -> dict[str, tuple[int, int]]:
        return self.index.have()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if self._follower is None and self._control_plane is not None:
            self._follower = threading.Thread(
                target=self._follow_sketches,
                args=(self._control_plane, asyncio.get_running_loop()),
                name="prefix-sketch-sync",
                daemon=True,
            )
            self._follower.start()
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
        for request in requests_of(pending_request) or [None]:
            self.policy.routed(request, replica_id.unique_id)
