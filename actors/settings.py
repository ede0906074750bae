"""The Serve application's configuration: `serve_config.yaml` `args`, validated by pydantic.

`AppConfig` is `app.settings.Settings` (the HTTP surface, `engine` as the engine's own
`EngineConfig`, the policy names; environment overrides; unknown keys are errors) plus the
sections that only Serve mode has: one per deployment. Bare mode reads the same `args`.

    FIRSTLIGHT_ENGINE__SCHEDULER__MAX_NUM_SEQS=8 serve run serve_config.yaml
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.settings import Settings

_SECTION = ConfigDict(extra="forbid", frozen=True)
_RAY_BUILTIN = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class DeploymentSection(BaseModel):
    """What every deployment's section says about where its replicas run: `num_cpus` and
    `resources`, custom Ray resources each replica needs (Ray's `ray_actor_options`). A
    replica goes only to a node started with enough of them, e.g. `resources: {node2: 0.01}`
    pins it to nodes started with `ray start --resources='{"node2": 1}'`."""

    model_config = _SECTION

    num_cpus: float = Field(0.1, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in _RAY_BUILTIN:
                raise ValueError(f"{name!r} is Ray's own resource, not a custom one")
            if amount <= 0 or (amount > 1 and not float(amount).is_integer()):
                raise ValueError(
                    f"{name}: {amount} (Ray takes a fraction up to 1, or a whole number)"
                )
        return resources

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class AutoscalingSettings(BaseModel):
    """Serve's autoscaler on ModelReplica. `min_replicas` stays warm (a cold replica would
    make the first request wait for a model load), so it is at least 1."""

    model_config = _SECTION

    min_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        initial = self.initial_replicas or self.min_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                "autoscaling needs min_replicas <= initial_replicas <= max_replicas "
                f"(got {self.min_replicas}, {initial}, {self.max_replicas})"
            )
        return self

    def serve_config(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class ReplicaSettings(DeploymentSection):
    """ModelReplica deployment options. Its `max_ongoing_requests` is derived from the engine
    (`AppConfig.replica_max_ongoing_requests`), so the engine's own admission decides, and
    Serve's queue (`max_queued_requests`) is a last resort."""

    num_cpus: float = Field(0.6, ge=0)
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    max_queued_requests: int = Field(64, ge=1)  # per caller, when every replica is full
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)
    stats_interval_s: float = Field(0.5, gt=0)  # push period of stats to the control plane
    graceful_shutdown_timeout_s: float = Field(10.0, ge=0)


class IngressSettings(DeploymentSection):
    """How deltas cross the replica → caller hop (any deployment's `ReplicaClient`).

    `token_path`: "channel" (default) sends them over the token channel, one frame per engine
    step for all of a caller's requests (actors/token_channel.py), with each request still
    one Serve call; "stream" makes each delta an item of a Serve streaming call.
    `channel_tcp_host`: where the caller also listens for replicas on other nodes ("auto":
    the node's Ray address; "off": Unix socket only, single-node clusters).
    `transport`: how Serve carries the calls themselves: "grpc" (Serve's direct gRPC channel
    between replicas, plain pickle) or "actor" (Ray actor calls)."""

    token_path: Literal["channel", "stream"] = "channel"
    channel_tcp_host: str = "auto"
    transport: Literal["grpc", "actor"] = "grpc"
    num_cpus: float = Field(0.4, ge=0)
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(512, ge=1)  # concurrent HTTP requests per ingress
    sync_interval_s: float = Field(0.5, gt=0)  # metrics push + cluster-view refresh period
    info_timeout_s: float = Field(300.0, gt=0)  # how long startup waits for a first replica

    def handle_options(self) -> dict[str, Any]:
        if self.transport == "grpc":
            return {
                "_by_reference": False,
                "request_serialization": "pickle",
                "response_serialization": "pickle",
            }
        return {}


class DraftReplicaSettings(DeploymentSection):
    """The DraftReplica deployment (actors/draft_replica.py): it serves the drafts of
    `engine.speculative.draft_model` to every ModelReplica when `engine.speculative.method` is
    "draft_model" and `enabled` is true (false: each replica runs the draft in its own
    process). `timeout_s`: a draft call slower than this is dropped and the target decodes
    without drafts (backing off 1 s, doubling to 30 s, while the draft stays unreachable).
    `host`: "auto" listens on the node's address (targets on other nodes reach it),
    "loopback" on 127.0.0.1 only."""

    enabled: bool = True
    num_cpus: float = Field(0.2, ge=0)
    kv_cache_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    timeout_s: float = Field(0.25, gt=0)
    host: Literal["auto", "loopback"] = "auto"
    address_refresh_s: float = Field(1.0, gt=0)  # how often a target without one asks again


class BatchJobsSettings(DeploymentSection):
    """The BatchJobs deployment (actors/batch_jobs.py), deployed when `batch.enabled`."""

    num_cpus: float = Field(0.1, ge=0)


class ControlPlaneSettings(DeploymentSection):
    num_cpus: float = Field(0.1, ge=0)
    report_ttl_s: float = Field(3.0, gt=0)  # a replica or ingress silent this long is dropped


class AppConfig(Settings):
    """The whole application. Build one with `AppConfig(**args)`; bad values raise
    `pydantic.ValidationError` naming the field."""

    replica: ReplicaSettings = ReplicaSettings()
    ingress: IngressSettings = IngressSettings()
    control_plane: ControlPlaneSettings = ControlPlaneSettings()
    draft_replica: DraftReplicaSettings = DraftReplicaSettings()
    batch_jobs: BatchJobsSettings = BatchJobsSettings()

    @property
    def uses_draft_replica(self) -> bool:
        return self.engine.speculative.method == "draft_model" and self.draft_replica.enabled

    @property
    def replica_max_ongoing_requests(self) -> int:
        """Calls one replica takes at once: what its engine can hold (seats + waiting) plus
        `max_waiting` more, so a request past the engine's bounds reaches the engine and is
        refused at once by the one admission decision (engine/sched/admission.py) instead of
        waiting in Serve's queue for a stream to end."""
        scheduler = self.engine.scheduler
        return scheduler.max_num_seqs + 2 * scheduler.max_waiting
