"""The Ingress deployment: the app/ FastAPI app, served by Ray Serve.

What it adds to the app, and nothing else:
* the endpoint's engine is a `ReplicaClient` over the ModelReplica handle, so every token
  crosses exactly one actor hop (replica → here) before the app writes it;
* a background task syncs with the Scheduler every `sync_interval_s`: it pushes this
  ingress's HTTP metrics and gets back the cluster view plus everyone else's metrics. Requests
  read only that local `ClusterCache` (early 503, `/metrics`), never the Scheduler;
* `/metrics` renders this ingress's fresh metrics merged with the cached rest, so one scrape
  covers every replica and every ingress.

Startup waits until a ModelReplica answers (and is warm) and, briefly, for the first view
that lists it, so the first requests are not refused as "no replica".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.cluster import ClusterCache, IngressReport
from actors.messages import ReplicaInfo
from actors.replica_client import ReplicaClient
from actors.runtime import replica_id
from actors.settings import AppConfig
from app.endpoint import ModelEndpoint
from app.metric_snapshot import Snapshot
from app.metrics import Metrics
from app.openai_server import build_app
from app.settings import Settings
from engine.process import freeze_startup_heap
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("firstlight.ingress")


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    async def __init__(
        self, config: AppConfig, replicas: DeploymentHandle, scheduler: DeploymentHandle
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.ingress_id = replica_id()
        interval = config.ingress.sync_interval_s
        self.cache = ClusterCache(
            model=config.served_model_name,
            stale_after_s=max(3 * interval, config.scheduler.report_ttl_s),
        )
        self.metrics = Metrics(max_label_values=config.max_label_values)  # HTTP metrics only
        async with asyncio.timeout(config.ingress.info_timeout_s):
            info: ReplicaInfo = await replicas.info.remote()
        self.endpoint = ModelEndpoint(
            name=config.served_model_name,
            tokenizer=await asyncio.to_thread(load_tokenizer, info.model_path),
            max_model_len=info.max_model_len,
            client=ReplicaClient(
                replicas,
                admit=self.cache.admit,
                stats=self.cache.stats,
                transport=config.ingress.handle_options(),
            ),
            root=config.engine.model,
        )
        self._sync_task = asyncio.create_task(self._sync_loop(), name="ingress-sync")
        await self._wait_for_first_view(timeout_s=max(5.0, 10 * interval))
        freeze_startup_heap()

    def __serve_build_asgi_app__(self) -> FastAPI:
        config = self.config
        settings = Settings(
            served_model_name=config.served_model_name,
            max_body_bytes=config.max_body_bytes,
            keepalive_s=config.keepalive_s,
            stall_timeout_s=config.stall_timeout_s,
            max_n=config.max_n,
            max_label_values=config.max_label_values,
            request_class_policy=config.policies.request_class,
        )
        app = build_app([self.endpoint], settings, metrics=self.metrics, extra_metrics=self._others)
        app.add_middleware(_OneRequestIdHeader)
        return app

    async def _others(self) -> Iterable[Snapshot]:
        return [self.cache.snapshot.metrics]

    # -- the control-plane sync ----------------------------------------------------------

    async def _sync_once(self) -> None:
        report = IngressReport(self.ingress_id, self.metrics.snapshot())
        async with asyncio.timeout(max(1.0, 4 * self.config.ingress.sync_interval_s)):
            snapshot = await self.scheduler.sync.remote(report)
        self.cache.update(snapshot)

    async def _sync_loop(self) -> None:
        while True:
            try:
                await self._sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the cache goes stale; requests still flow
                logger.debug("scheduler sync failed: %r", exc)
            await asyncio.sleep(self.config.ingress.sync_interval_s)

    async def _wait_for_first_view(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.cache.seen_replica and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.cache.seen_replica:
            logger.warning(
                "no replica in the cluster view after %.0f s; starting anyway", timeout_s
            )

    async def __del__(self) -> None:
        task = getattr(self, "_sync_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class _OneRequestIdHeader:
    """The Serve proxy echoes `x-request-id` on every response itself (the same id the app
    read from the request), so the app's own copy is dropped to send the header once."""

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
