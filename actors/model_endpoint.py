"""What every deployment that sends requests to the model replicas shares (the Ingress, and
BatchJobs): a `ReplicaClient` over the ModelReplica handle, admitted and routed by a local
`ClusterCache`, the `ModelEndpoint` the OpenAI layer serves, and the loop that keeps the
cache fresh from the control plane (pushing the caller's own metrics on the way)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.serve.handle import DeploymentHandle

from actors.bulk_gate import BulkGate
from actors.cluster import ClusterCache, IngressReport
from actors.messages import ReplicaInfo
from actors.replica_client import ReplicaClient
from actors.runtime import node_ip
from actors.settings import AppConfig
from app.endpoint import ModelEndpoint
from app.metric_snapshot import Snapshot
from demo.paths import ModelNotFoundError, resolve_model
from engine.models.resolve import ModelResolver
from engine.tokenizer import load_tokenizer, tokenizer_digest
from policies.base import create
from policies.bulk_throttle import BulkThrottle

logger = logging.getLogger("firstlight.ingress")


def cluster_cache(config: AppConfig) -> ClusterCache:
    interval = config.ingress.sync_interval_s
    return ClusterCache(
        model=config.served_model_name,
        stale_after_s=max(3 * interval, config.control_plane.report_ttl_s),
        serverless=config.replica.autoscaling.serverless,
    )


def bulk_gate(config: AppConfig, cache: ClusterCache) -> BulkGate:
    """Where an ingress holds its bulk requests until the cluster has spare capacity."""
    policies = config.policies
    ingress = config.ingress
    return BulkGate(
        create(BulkThrottle, policies.bulk_throttle, **policies.options("bulk_throttle")),
        cache.replica_stats,
        max_wait_s=ingress.bulk_max_wait_s,
        max_waiting=ingress.bulk_max_waiting,
        retry_after=cache.retry_after_s,
        view_age_s=2 * (ingress.sync_interval_s + config.replica.stats_interval_s),
    )


async def connect_endpoint(
    config: AppConfig,
    replicas: DeploymentHandle,
    owner_id: str,
    cache: ClusterCache,
    resolve: ModelResolver = resolve_model,
    gate: BulkGate | None = None,
) -> tuple[ReplicaClient, ModelEndpoint]:
    """A client of the replicas and the endpoint over it (waits for a replica's info).

    The tokenizer loads on this process's node, from `engine.model` resolved here (a local
    directory, or the demo built on this node), never from the replica's path, which may
    exist only on the replica's node. A tokenizer that differs from the replica's (its
    `tokenizer_digest`) fails here: token ids would mean other words on the two sides."""
    client = await ReplicaClient.connect(
        replicas,
        config.ingress,
        owner_id=owner_id,
        admit=cache.admit,
        stats=cache.stats,
        retry_after=cache.retry_after_s,
        capacity=cache.check_capacity,
        gate=gate,
    )
    try:
        tokenizer, digest = await asyncio.to_thread(_local_tokenizer, config.engine.model, resolve)
        async with asyncio.timeout(config.ingress.info_timeout_s):
            info: ReplicaInfo = await replicas.info.remote()
        if digest != info.tokenizer_digest:
            raise TokenizerMismatchError(
                f"engine.model {config.engine.model!r} resolves on this node "
                f"({node_ip()}) to a tokenizer other than the one replica {info.replica_id} "
                f"serves (from {info.model_path} on its node): build or copy the same model "
                "on every node"
            )
    except BaseException:
        await client.close()
        raise
    scheduler = config.engine.scheduler
    endpoint = ModelEndpoint(
        name=config.served_model_name,
        tokenizer=tokenizer,
        max_model_len=info.max_model_len,
        client=client,
        root=config.engine.model,
        # what one replica's engine can ever hold: seats + waiting places
        max_requests=scheduler.max_num_seqs + scheduler.max_waiting,
    )
    return client, endpoint


class TokenizerMismatchError(RuntimeError):
    """This node's tokenizer for `engine.model` is not the one the model replicas use."""


def _local_tokenizer(model: str, resolve: ModelResolver) -> tuple[Any, str]:
    """`model`'s tokenizer as this node resolves it, and its digest."""
    try:
        path = resolve(model)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"engine.model on this node ({node_ip()}): {exc}") from None
    tokenizer = load_tokenizer(path)
    return tokenizer, tokenizer_digest(tokenizer)


async def sync_forever(
    control_plane: DeploymentHandle,
    cache: ClusterCache,
    reporter_id: str,
    metrics: Callable[[], Snapshot],
    interval_s: float,
) -> None:
    """Push `metrics()` and refresh `cache` every `interval_s`; a failed sync leaves the
    cache to go stale (requests still flow)."""
    while True:
        try:
            report = IngressReport(reporter_id, metrics())
            async with asyncio.timeout(max(1.0, 4 * interval_s)):
                snapshot = await control_plane.sync.remote(report)
            cache.update(snapshot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.debug("control plane sync failed: %r", exc)
        await asyncio.sleep(interval_s)


async def disconnect(sync_task: asyncio.Task | None, client: ReplicaClient | None) -> None:
    """Stop the sync loop and close the replica client (either may be None: an `__init__`
    that failed early)."""
    if sync_task is not None:
        sync_task.cancel()
        with contextlib.suppress(BaseException):
            await sync_task
    if client is not None:
        await client.close()


async def wait_for_first_view(cache: ClusterCache, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cache.seen_replica and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not cache.seen_replica:
        logger.warning("no replica in the cluster view after %.0f s; starting anyway", timeout_s)
