"""The Ingress deployment: the app/ FastAPI app, served by Ray Serve.

What it adds to the app, and nothing else:
* the endpoint's engine is a `ReplicaClient` over the ModelReplica handle, so every token
  crosses exactly one actor hop (replica → here) before the app writes it: by default over
  this ingress's token channel (the client's own `ChannelServer`, see
  `ReplicaClient.connect` and actors/token_channel.py);
* a background task syncs with the control plane every `sync_interval_s`: it pushes this
  ingress's HTTP metrics and gets back the cluster view plus everyone else's metrics. Requests
  read only that local `ClusterCache` (early 503, `/metrics`), never the control plane;
* `/metrics` renders this ingress's fresh metrics merged with the cached rest, so one scrape
  covers every replica and every ingress; an ingress's own metrics include its token
  channel's accepted connections by transport (unix: same node, tcp: another node);
* a stalled HTTP reader can be cut. Clients normally reach this deployment's own HTTP server
  (Serve's direct ingress, serve_config.yaml), whose `send` blocks while the client does not
  read, so the SSE writer's send timeout cuts it. Through Serve's proxy (the fallback port),
  `send` never blocks (it queues messages for the proxy, which stops taking them while its
  client does not read), so the outermost layer (`_SendBacklog`) tells the SSE writer how
  long the oldest queued message has waited.

Startup waits until a ModelReplica answers (and is warm) and, briefly, for the first view
that lists it, so the first requests are not refused as "no replica".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.model_endpoint import (
    bulk_gate,
    cluster_cache,
    connect_endpoint,
    disconnect,
    sync_forever,
    wait_for_first_view,
)
from actors.runtime import replica_id, route_logs
from actors.serve_internals import serve_send_queue
from actors.settings import AppConfig
from app.metric_snapshot import Snapshot, merge_snapshots
from app.metrics import Metrics
from app.openai_server import build_app
from app.sse import SEND_BACKLOG_KEY
from engine.process import freeze_startup_heap

logger = logging.getLogger("firstlight.ingress")


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    async def __init__(
        self,
        config: AppConfig,
        replicas: DeploymentHandle,
        control_plane: DeploymentHandle,
        batch_jobs: DeploymentHandle | None = None,  # runs what /v1/batches creates
    ) -> None:
        route_logs()
        self.config = config
        self.control_plane = control_plane
        self.ingress_id = replica_id()
        interval = config.ingress.sync_interval_s
        self.cache = cluster_cache(config)
        self.metrics = Metrics(max_label_values=config.max_label_values)  # HTTP metrics only
        self.gate = bulk_gate(config, self.cache)
        self.client, self.endpoint = await connect_endpoint(
            config, replicas, self.ingress_id, self.cache, gate=self.gate
        )
        self._sync_task = asyncio.create_task(
            sync_forever(control_plane, self.cache, self.ingress_id, self._own_metrics, interval),
            name="ingress-sync",
        )
        await wait_for_first_view(self.cache, timeout_s=max(5.0, 10 * interval))
        freeze_startup_heap()

    def __serve_build_asgi_app__(self) -> Any:
        app = build_app(  # an AppConfig is the app's Settings, plus the deployment sections
            [self.endpoint], self.config, metrics=self.metrics, extra_metrics=self._others
        )
        app.add_middleware(_OneRequestIdHeader)
        return _SendBacklog(app)

    def _own_metrics(self) -> Snapshot:
        """What this ingress pushes to the control plane: its HTTP metrics, its channel's and
        its bulk gate's."""
        return merge_snapshots(
            self.metrics.snapshot(), self._channel_metrics(), self.gate.snapshot()
        )

    def _channel_metrics(self) -> Snapshot:
        channel = self.client.channel
        return {} if channel is None else channel.snapshot()

    async def _others(self) -> Iterable[Snapshot]:
        """Beside this ingress's HTTP metrics: the cluster's (the replicas', the other
        ingresses'; the control plane leaves this one's out) and this one's channel and bulk
        gate."""
        return [self.cache.snapshot.metrics, self._channel_metrics(), self.gate.snapshot()]

    async def __del__(self) -> None:
        await disconnect(getattr(self, "_sync_task", None), getattr(self, "client", None))


class _OneRequestIdHeader:
    """Serve echoes `x-request-id` on every response itself, from its proxy and from the
    Ingress's own HTTP server alike (the same id the app read from the request), so the
    app's own copy is dropped to send the header once."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_once(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    (k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"
                ]
            await send(message)

        await self.app(scope, receive, send_once)


class _SendBacklog:
    """The outermost ASGI layer: times each message the app sends and reads how many are
    still in Serve's queue to the proxy, so `scope[SEND_BACKLOG_KEY]()` is how long the
    oldest of those has waited (0 when none). Serve's queue is found in its `send` closure
    (`actors.serve_internals.serve_send_queue`); if a Serve version hides it, the key is
    absent and no stall is ever reported."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (pending := serve_send_queue(send)) is not None:
            tracker = _Backlog(send, pending)
            scope[SEND_BACKLOG_KEY] = tracker.oldest_wait_s
            send = tracker.send
        await self.app(scope, receive, send)


class _Backlog:
    __slots__ = ("_pending", "_send", "_times")

    def __init__(self, send: Any, pending: Callable[[], int]) -> None:
        self._send = send
        self._pending = pending
        self._times: deque[float] = deque()

    async def send(self, message: Any) -> None:
        self._times.append(time.monotonic())
        await self._send(message)

    def oldest_wait_s(self) -> float:
        times = self._times
        unsent = self._pending()
        while len(times) > unsent:  # taken by the proxy: the oldest ones go first
            times.popleft()
        return time.monotonic() - times[0] if times else 0.0
