"""The Serve application's configuration: `serve_config.yaml` `args`, validated by pydantic.

Every field can be overridden from the environment with the `FIRSTLIGHT_` prefix, nested
sections joined by `__`, and the environment wins over the YAML:

    FIRSTLIGHT_ENGINE__MAX_NUM_SEQS=8 FIRSTLIGHT_KEEPALIVE_S=5 serve run serve_config.yaml

Unknown keys are errors (a typo must not silently fall back to a default). The HTTP fields
share their names (and so their environment variables) with `app.settings.Settings`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from engine.config import CacheConfig, EngineConfig, SchedulerConfig

_SECTION = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(BaseModel):
    """What each ModelReplica's `AsyncEngine` is built from (see `engine.config`)."""

    model_config = _SECTION

    model: str = "demo"  # a local HF directory, or "demo"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    max_model_len: int | None = Field(None, ge=16)
    attention_backend: str | None = None
    seed: int = 0
    kv_cache_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    num_blocks: int | None = Field(None, ge=1)  # wins over kv_cache_bytes when set
    enable_prefix_caching: bool = True
    max_num_seqs: int = Field(32, ge=1)  # running sequences per step
    max_waiting: int = Field(128, ge=1)  # waiting queue bound; past it the engine answers 429
    max_num_batched_tokens: int = Field(1024, ge=16)  # token budget of one step
    bulk_min_share: float = Field(0.1, ge=0.0, le=1.0)
    stall_timeout_s: float = Field(30.0, gt=0)  # output left unread this long aborts it

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            seed=self.seed,
            cache=CacheConfig(
                num_blocks=self.num_blocks,
                kv_cache_bytes=self.kv_cache_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_waiting=self.max_waiting,
                bulk_min_share=self.bulk_min_share,
            ),
        )


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


class ReplicaSettings(BaseModel):
    """ModelReplica deployment options. Its `max_ongoing_requests` is derived from the engine
    (`max_num_seqs + max_waiting`), so the engine's own bounded queue is the one that fills."""

    model_config = _SECTION

    num_cpus: float = Field(0.7, ge=0)
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    max_queued_requests: int = Field(64, ge=1)  # per caller, when every replica is full
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)
    stats_interval_s: float = Field(0.5, gt=0)  # push period of stats to the control plane
    graceful_shutdown_timeout_s: float = Field(10.0, ge=0)


class IngressSettings(BaseModel):
    """How deltas cross the replica → ingress hop.

    `token_path`: "channel" (default) sends them over the token channel, one frame per engine
    step for all of an ingress's requests (actors/token_channel.py), with each request still
    one Serve call; "stream" makes each delta an item of a Serve streaming call.
    `channel_tcp_host`: where the ingress also listens for replicas on other nodes ("auto":
    the node's Ray address; "off": Unix socket only, single-node clusters).
    `transport`: how Serve carries the calls themselves: "grpc" (Serve's direct gRPC channel
    between replicas, plain pickle) or "actor" (Ray actor calls)."""

    model_config = _SECTION

    token_path: Literal["channel", "stream"] = "channel"
    channel_tcp_host: str = "auto"
    transport: Literal["grpc", "actor"] = "grpc"
    num_cpus: float = Field(0.5, ge=0)
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


class ControlPlaneSettings(BaseModel):
    model_config = _SECTION

    num_cpus: float = Field(0.1, ge=0)
    report_ttl_s: float = Field(3.0, gt=0)  # a replica or ingress silent this long is dropped


class PolicySettings(BaseModel):
    """Policy names, each looked up in its `policies/` registry when the app is built.
    `routing_options[name]` go to routing policy `name`'s constructor when it is the one
    chosen (so switching `routing`, e.g. by environment, needs no other change)."""

    model_config = _SECTION

    request_class: str = "header"
    routing: str = "prefix_affinity"
    routing_options: dict[str, dict[str, Any]] = Field(default_factory=dict)


class AppConfig(BaseSettings):
    """The whole application. Build one with `AppConfig(**args)`; bad values raise
    `pydantic.ValidationError` naming the field."""

    model_config = SettingsConfigDict(
        env_prefix="FIRSTLIGHT_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    served_model_name: str = "demo"  # what clients send as `model`
    keepalive_s: float = Field(15.0, gt=0)  # idle gap before an SSE `:` keepalive comment
    stall_timeout_s: float = Field(60.0, gt=0)  # an HTTP client reading nothing this long is cut
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_n: int = Field(16, ge=1)
    max_label_values: int = Field(32, ge=1)  # distinct tag values per metric label
    engine: EngineSettings = EngineSettings()
    replica: ReplicaSettings = ReplicaSettings()
    ingress: IngressSettings = IngressSettings()
    control_plane: ControlPlaneSettings = ControlPlaneSettings()
    policies: PolicySettings = PolicySettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)  # the environment overrides serve_config args

    @property
    def replica_max_ongoing_requests(self) -> int:
        return self.engine.max_num_seqs + self.engine.max_waiting
