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
    """Serve's autoscaler on ModelReplica, driven by `policies.autoscaling` (the policy named
    in `policies.autoscaling`, over queue depth, KV usage and TTFT per class; see
    actors/autoscaler.py).

    `mode`: "dedicated" keeps `min_replicas` (at least 1) warm, so no request ever waits for
    a model load; "serverless" scales to zero when idle (`min_replicas` 0, after
    `downscale_to_zero_delay_s`), and a request that finds no replica waits for one to start
    (streams get SSE keepalives meanwhile) instead of failing. `target_ongoing_requests` is
    the queue depth one replica is meant to carry; `look_back_period_s` is Serve's window for
    the request counts (and, a fifth of it, how often replicas record them)."""

    model_config = _SECTION

    mode: Literal["dedicated", "serverless"] = "dedicated"
    min_replicas: int | None = Field(None, ge=0)  # None: 1 when dedicated, 0 when serverless
    initial_replicas: int | None = Field(None, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    downscale_to_zero_delay_s: float | None = Field(None, ge=0)
    look_back_period_s: float = Field(5.0, gt=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        floor = self.floor
        if self.mode == "dedicated" and floor < 1:
            raise ValueError(
                "min_replicas: a dedicated deployment keeps at least 1 replica warm "
                "(mode: serverless scales to zero)"
            )
        if self.mode == "serverless" and floor != 0:
            raise ValueError("min_replicas: a serverless deployment scales to zero (set 0)")
        initial = self.initial_replicas if self.initial_replicas is not None else floor
        if not floor <= initial <= self.max_replicas:
            raise ValueError(
                "autoscaling needs min_replicas <= initial_replicas <= max_replicas "
                f"(got {floor}, {initial}, {self.max_replicas})"
            )
        return self

    @property
    def floor(self) -> int:
        """`min_replicas`, or the mode's default."""
        if self.min_replicas is not None:
            return self.min_replicas
        return 1 if self.mode == "dedicated" else 0

    @property
    def serverless(self) -> bool:
        return self.mode == "serverless"

    def serve_config(self, policy: str, options: dict[str, Any]) -> dict[str, Any]:
        """Serve's `autoscaling_config`, with `policy` (and its `options`) as the policy."""
        config = self.model_dump(exclude_none=True, exclude={"mode"})
        config["min_replicas"] = self.floor
        # Replicas record their load every min(look_back_period_s / 5, metrics_interval_s);
        # the push to the controller is RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S (1 s,
        # serve_config.yaml), and Serve wants look_back_period_s above metrics_interval_s.
        config["metrics_interval_s"] = 1.0
        config["policy"] = {
            "policy_function": "actors.autoscaler:ReplicaAutoscaler",
            "policy_kwargs": {
                "policy": policy,
                "target_ongoing_requests": self.target_ongoing_requests,
                **options,
            },
        }
        return config


class ReplicaSettings(DeploymentSection):
    """ModelReplica deployment options. Its `max_ongoing_requests` is derived from the engine
    (`AppConfig.replica_max_ongoing_requests`), so the engine's own admission decides, and
    Serve's queue (`max_queued_requests`) is a last resort."""

    num_cpus: float = Field(0.6, ge=0)
    # GPUs per replica; None: 1 when its engine runs on CUDA (`engine.device` "cuda", or
    # "auto" on a cluster with GPUs), else 0 (AppConfig.replica_num_gpus)
    num_gpus: float | None = Field(None, ge=0)
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    # Calls an ingress's Serve router holds before it has handed them to a replica; past it,
    # 429. The ingress refuses past the replicas' seats and waiting places itself, so this
    # only has to hold a burst the ingress admitted while the router assigns it (64 turned
    # away 95 of the 160 a replica could take, under a 600-stream burst: bench/admission.py).
    max_queued_requests: int = Field(512, ge=1)
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
    between replicas, plain pickle) or "actor" (Ray actor calls).
    `bulk_group_max`: bulk requests that want their output whole and start in the same
    event-loop pass share one Serve call, at most this many (1: a call each; channel path
    only; see actors/replica_client.py)."""

    token_path: Literal["channel", "stream"] = "channel"
    channel_tcp_host: str = "auto"
    transport: Literal["grpc", "actor"] = "grpc"
    bulk_group_max: int = Field(16, ge=1)
    num_cpus: float = Field(0.4, ge=0)
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(512, ge=1)  # concurrent HTTP requests per ingress
    sync_interval_s: float = Field(0.5, gt=0)  # metrics push + cluster-view refresh period
    info_timeout_s: float = Field(300.0, gt=0)  # how long startup waits for a first replica
    # Bulk requests wait at the ingress for spare capacity (policies.bulk_throttle) at most
    # this long (under the SSE keepalive gap, so a refusal is a 429, not a stream error), and
    # at most this many at once; past either, 429 + Retry-After.
    bulk_max_wait_s: float = Field(10.0, ge=0)
    bulk_max_waiting: int = Field(256, ge=0)

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
    """The BatchJobs deployment (actors/batch_jobs.py), deployed when `batch.enabled`.

    `nice`: the niceness every thread of its process adds at start (`actors.runtime.renice`),
    so offline work yields the CPU to the processes serving chat where they share cores. Off
    by default: on the 2-core VM, 10 cost the batch ~9% of its throughput alone (its line
    refills lag, 26.6 vs 28.8 of 32 seats busy) for a chat TTFT gain within the noise."""

    num_cpus: float = Field(0.1, ge=0)
    nice: int = Field(0, ge=0, le=19)


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

    def replica_num_gpus(self, cluster_gpus: float) -> float:
        """GPUs Serve gives each ModelReplica, on a cluster with `cluster_gpus` GPUs."""
        if self.replica.num_gpus is not None:
            return self.replica.num_gpus
        device = self.engine.device
        return 1.0 if device.startswith("cuda") or (device == "auto" and cluster_gpus > 0) else 0.0

    @property
    def replica_max_ongoing_requests(self) -> int:
        """Calls one replica takes at once: what its engine can hold (seats + waiting) plus
        `max_waiting` more, so a request past the engine's bounds reaches the engine and is
        refused at once by the one admission decision (engine/sched/admission.py) instead of
        waiting in Serve's queue for a stream to end."""
        scheduler = self.engine.scheduler
        return scheduler.max_num_seqs + 2 * scheduler.max_waiting
