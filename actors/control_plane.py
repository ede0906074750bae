"""The ControlPlane deployment: one replica, never in the token path.

It only answers periodic pushes (ModelReplica stats, ingress metrics) and hands back the
cluster view; nothing calls it per request or per token, and no caller blocks a request on
it (ingresses refresh a local cache in the background). If it restarts, the view refills
within one report period. All logic lives in `actors.cluster.ClusterState`.
"""

from __future__ import annotations

from ray import serve

from actors.cluster import (
    ClusterSnapshot,
    ClusterState,
    ClusterView,
    IngressReport,
    ReplicaReport,
    RouterSync,
)
from actors.runtime import route_logs
from actors.settings import ControlPlaneSettings


@serve.deployment(name="ControlPlane", num_replicas=1, max_ongoing_requests=1000)
class ControlPlane:
    def __init__(self, settings: ControlPlaneSettings) -> None:
        route_logs()
        self.state = ClusterState(ttl_s=settings.report_ttl_s)

    async def report_replica(self, report: ReplicaReport) -> bool:
        """False: the report's sketch diff did not fit; the replica sends its whole sketch
        next time."""
        return self.state.report_replica(report)

    async def remove_replica(self, replica_id: str) -> None:
        """A replica shutting down leaves the view at once instead of after the TTL."""
        self.state.remove_replica(replica_id)

    async def sync(self, report: IngressReport) -> ClusterSnapshot:
        return self.state.sync(report)

    async def router_sync(self, have: dict[str, tuple[int, int]], model: str) -> RouterSync:
        """What a router needs: the replicas' prefix sketches (diffs from what it `have`s) and
        their latest stats."""
        return self.state.sync_router(have, model)

    async def cluster_view(self) -> ClusterView:
        return self.state.view()
