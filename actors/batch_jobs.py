"""The BatchJobs deployment: runs the batches clients create through `/v1/batches`.

Every Ingress serves the files and batches endpoints over the shared `BatchStore` (SQLite +
file bodies in `batch.directory`); this deployment (one replica) runs the batches from that
same store with `app.batch.runner.BatchRunner`: each line is a `bulk` request through the
same OpenAI layer and the same replica routing as HTTP traffic (its own `ReplicaClient` and
cluster view, like an ingress), with as many lines in flight as the cluster bulk throttle
(`policies.bulk_throttle`) allows from that view. A replacement (after a crash or a kill)
resumes every unfinished batch from the store, skipping the lines whose results were
stored. Its progress metrics reach `/metrics` through the control plane, like an ingress's.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.model_endpoint import (
    cluster_cache,
    connect_endpoint,
    disconnect,
    sync_forever,
    wait_for_first_view,
)
from actors.runtime import renice, replica_id, route_logs
from actors.settings import AppConfig
from app.batch.runner import BatchRunner
from app.batch.store import BatchStore
from app.endpoint import Endpoints
from app.openai.prepare import OpenAILayer
from policies.base import create
from policies.bulk_throttle import BulkThrottle, RecentMax, bulk_room
from policies.request_class import RequestClassPolicy

logger = logging.getLogger("firstlight.batch")


@serve.deployment(name="BatchJobs")
class BatchJobs:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, config: AppConfig, replicas: DeploymentHandle, control_plane: DeploymentHandle
    ) -> None:
        route_logs()
        if config.batch_jobs.nice:
            renice(config.batch_jobs.nice)  # this process only: the actor has its own
        self.id = replica_id()
        interval = config.ingress.sync_interval_s
        self.cache = cluster_cache(config)
        self.client, endpoint = await connect_endpoint(config, replicas, self.id, self.cache)
        classifier = create(RequestClassPolicy, config.request_class_policy)
        layer = OpenAILayer(Endpoints([endpoint]), classifier, max_n=config.max_n)
        self.store = BatchStore(config.batch.path())
        policies = config.policies
        throttle = create(BulkThrottle, policies.bulk_throttle, **policies.options("bulk_throttle"))
        cache = self.cache
        reported = RecentMax(2 * (interval + config.replica.stats_interval_s))

        def capacity(own: int) -> int:  # lines in flight: the throttle's room for them
            return own + bulk_room(throttle, cache.replica_stats(), own, reported.note(own))

        bunch = config.ingress.bulk_group_max
        self.runner = BatchRunner(self.store, layer, capacity, bunch=bunch)
        sync = sync_forever(control_plane, self.cache, self.id, self.runner.snapshot, interval)
        self._sync_task = asyncio.create_task(sync, name="batch-sync")
        await wait_for_first_view(self.cache, timeout_s=max(5.0, 10 * interval))
        self.runner.start()
        logger.info("batch jobs %s running from %s", self.id, self.store.directory)

    async def check_health(self) -> None:
        if not self.runner.is_running:
            raise RuntimeError("the batch runner stopped")

    async def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            await runner.stop()
        await disconnect(getattr(self, "_sync_task", None), getattr(self, "client", None))
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
