"""`serve_config.yaml` → a Ray Serve application.

    applications:
      - name: firstlight
        import_path: actors.builder:build_app
        args: {served_model_name: demo, engine: {...}, replica: {...}, ...}

`build_app(args)` validates `args` (plus `FIRSTLIGHT_*` environment overrides) as an
`AppConfig`, checks that every named policy is registered, and wires three deployments:

    Ingress ──calls──▶ ModelReplica ×[min, max] (autoscaled) ──stats──▶ ControlPlane (×1)
       ▲  (routed by policies.routing)   │
       └──────── token channel ──────────┘
       └──────────── sync (metrics out, cluster view back) ─────────────────┘

Each deployment's section (`replica`, `ingress`, `control_plane`, `draft_replica`,
`batch_jobs`) gives its replicas' `num_cpus` and custom Ray `resources`, which place them on
the nodes that have those resources (README: "A two-node cluster on one machine").

Bad configuration fails here, at `serve run`, with a message naming the field.
"""

from __future__ import annotations

from typing import Any

import ray
from pydantic import ValidationError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from actors.batch_jobs import BatchJobs
from actors.control_plane import ControlPlane
from actors.draft_replica import DraftReplica
from actors.ingress import Ingress
from actors.model_replica import ModelReplica
from actors.settings import AppConfig
from demo.paths import ModelNotFoundError, resolve_model
from engine.sched.order import build_step_order
from policies.autoscaling import AutoscalingPolicy
from policies.base import create, lookup
from policies.bulk_throttle import BulkThrottle
from policies.request_class import RequestClassPolicy
from policies.routing import ReplicaRoutingPolicy

_BACKPRESSURE = {"status_code": 429, "retry_after_s": 1}
CONTROL_PLANE = "ControlPlane"  # the deployment's name: routers find it by name
_QUIET = {"enable_access_log": False}  # internal hops; the ingress's access log has each request


class ConfigError(ValueError):
    """The application config is invalid; the message says which field and why."""


def load_config(args: dict[str, Any] | None = None) -> AppConfig:
    try:
        config = AppConfig(**(args or {}))
    except ValidationError as exc:
        raise ConfigError(f"invalid firstlight application args:\n{exc}") from None
    policies = config.policies
    try:
        lookup(RequestClassPolicy, policies.request_class)
        create(ReplicaRoutingPolicy, policies.routing, **_routing_options(config))
        create(BulkThrottle, policies.bulk_throttle, **policies.options("bulk_throttle"))
        create(AutoscalingPolicy, policies.autoscaling, **_autoscaling_options(config))
        # the options of policies not chosen must be right too (switching must just work)
        for name, options in policies.routing_options.items():
            create(ReplicaRoutingPolicy, name, **options)
        for name, options in policies.bulk_throttle_options.items():
            create(BulkThrottle, name, **options)
        for name, options in policies.autoscaling_options.items():
            create(AutoscalingPolicy, name, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid firstlight application args: policies: {exc}") from None
    try:
        build_step_order(config.engine.scheduler)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"invalid firstlight application args: engine.scheduler.policy: {exc}"
        ) from None
    return config


def _routing_options(config: AppConfig) -> dict[str, Any]:
    policies = config.policies
    options = policies.options("routing")
    routing = policies.routing
    if routing == "prefix_affinity" or (
        routing == "class_pools" and options.get("inner", "prefix_affinity") == "prefix_affinity"
    ):
        options.setdefault("block_size", config.engine.cache.block_size)
    if routing == "class_pools":  # it lends bulk the seats the callers' throttle allows
        options.setdefault("throttle", policies.bulk_throttle)
        options.setdefault("throttle_options", policies.options("bulk_throttle"))
    return options


def _autoscaling_options(config: AppConfig) -> dict[str, Any]:
    options = config.policies.options("autoscaling")
    options.setdefault(
        "target_ongoing_requests", config.replica.autoscaling.target_ongoing_requests
    )
    return options


def request_router(config: AppConfig) -> RequestRouterConfig:
    """ModelReplica's request router: the configured `policies.routing` policy, run by
    `actors.request_router.PolicyRequestRouter` in each caller, following the replicas'
    prefix sketches from the control plane."""
    return RequestRouterConfig(
        request_router_class="actors.request_router.PolicyRequestRouter",
        request_router_kwargs={
            "policy": config.policies.routing,
            "control_plane": CONTROL_PLANE,
            "model": config.served_model_name,
            "sketch_sync_s": config.ingress.sync_interval_s,
            **_routing_options(config),
        },
    )


def autoscaling_config(config: AppConfig) -> dict[str, Any]:
    """ModelReplica's autoscaling: Serve's bounds and delays, the `policies.autoscaling`
    policy deciding (actors/autoscaler.py)."""
    options = _autoscaling_options(config)
    options.pop("target_ongoing_requests")
    return config.replica.autoscaling.serve_config(config.policies.autoscaling, options)


def application(config: AppConfig) -> Application:
    control_plane = ControlPlane.options(
        ray_actor_options=config.control_plane.ray_actor_options(),
        logging_config=_QUIET,
    ).bind(config.control_plane)
    replica = config.replica
    replicas = ModelReplica.options(
        autoscaling_config=autoscaling_config(config),
        max_ongoing_requests=config.replica_max_ongoing_requests,
        max_queued_requests=replica.max_queued_requests,
        backpressure_config=_BACKPRESSURE,
        health_check_period_s=replica.health_check_period_s,
        health_check_timeout_s=replica.health_check_timeout_s,
        graceful_shutdown_timeout_s=replica.graceful_shutdown_timeout_s,
        request_router_config=request_router(config),
        ray_actor_options=_replica_actor_options(config),
        logging_config=_QUIET,
    ).bind(config, control_plane, _draft_replica(config))
    ingress = config.ingress
    batch_jobs = None
    if config.batch.enabled:
        batch_jobs = BatchJobs.options(
            num_replicas=1,
            ray_actor_options=config.batch_jobs.ray_actor_options(),
            logging_config=_QUIET,
        ).bind(config, replicas, control_plane)
    return Ingress.options(
        num_replicas=ingress.num_replicas,
        max_ongoing_requests=ingress.max_ongoing_requests,
        max_queued_requests=ingress.max_ongoing_requests,
        backpressure_config=_BACKPRESSURE,
        ray_actor_options=ingress.ray_actor_options(),
    ).bind(config, replicas, control_plane, batch_jobs)


def _replica_actor_options(config: AppConfig) -> dict[str, Any]:
    """The ModelReplica's Ray options: its section's CPUs and resources, and a GPU when its
    engine runs on CUDA (a GPU-less head may build the app for GPU workers: Ray's view of the
    whole cluster decides "auto", else this machine's)."""
    options = config.replica.ray_actor_options()
    if ray.is_initialized():
        gpus = float(ray.cluster_resources().get("GPU", 0.0))
    else:
        import torch

        gpus = float(torch.cuda.device_count())
    num_gpus = config.replica_num_gpus(gpus)
    if num_gpus:
        options["num_gpus"] = num_gpus
    return options


def _draft_replica(config: AppConfig) -> Application | None:
    """The DraftReplica every ModelReplica asks for drafts (None: no speculation, or each
    replica drafts in its own process)."""
    if not config.uses_draft_replica:
        return None
    return DraftReplica.options(
        num_replicas=1,
        ray_actor_options=config.draft_replica.ray_actor_options(),
        health_check_period_s=5.0,
        logging_config=_QUIET,
    ).bind(config)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The `serve run` entry point (`import_path: actors.builder:build_app`).

    A missing model fails here with the engine's message (e.g. "run `make demo`"), rather
    than in a loop of replica restarts."""
    config = load_config(args)
    try:
        resolve_model(config.engine.model)
    except ModelNotFoundError as exc:
        raise ConfigError(f"engine.model: {exc}") from None
    return application(config)
