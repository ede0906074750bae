"""The ModelReplica deployment's autoscaler: a `policies.autoscaling` policy as Ray Serve's
custom autoscaling policy, and the record of its scale-up decisions.

Serve's controller builds one `ReplicaAutoscaler` per deployment from
`autoscaling_config.policy` (`actors/builder.py`) and calls it every control-loop tick with
an `AutoscalingContext`. The signals come from each replica's `record_autoscaling_stats`
(`ModelReplica.record_autoscaling_stats`, pushed to the controller every
`RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S`, set in serve_config.yaml): the
newest sample of each metric, aged by its timestamp. Serve applies the delays, factors and
bounds to what the policy wants, and brings a deployment at zero replicas up at once when a
request waits for it (serverless mode).

Cold start is timed from the decision: when the target grows between two ticks, Serve
decided it at the earlier one, so that tick's time is recorded in the cluster's key-value
store (`record_scale_up`); a new replica reads the latest decision made before it started
(`scale_up_decided_before`) and reports the time from it to its first token served.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from actors.serve_internals import cluster_record, put_cluster_record
from policies.autoscaling import AutoscalingPolicy, ReplicaSignals, ScalingSignals
from policies.base import create

logger = logging.getLogger("firstlight.autoscaler")

# The keys of `ModelReplica.record_autoscaling_stats` (-1: no sample in the window).
ONGOING = "ongoing"
KV_USAGE = "kv_usage"
TTFT_P95_INTERACTIVE = "ttft_p95_interactive_s"
TTFT_P95_BULK = "ttft_p95_bulk_s"
METRICS = (ONGOING, KV_USAGE, TTFT_P95_INTERACTIVE, TTFT_P95_BULK)
MAX_DECISIONS = 8  # scale-up decisions kept per deployment


def autoscaling_stats(
    ongoing: float, kv_usage: float, ttft_interactive: float | None, ttft_bulk: float | None
) -> dict[str, float]:
    """What a replica records for the autoscaler (Serve takes numbers only)."""
    return {
        ONGOING: float(ongoing),
        KV_USAGE: float(kv_usage),
        TTFT_P95_INTERACTIVE: -1.0 if ttft_interactive is None else float(ttft_interactive),
        TTFT_P95_BULK: -1.0 if ttft_bulk is None else float(ttft_bulk),
    }


class ReplicaAutoscaler:
    """`autoscaling_config.policy`: {policy_function: "actors.autoscaler:ReplicaAutoscaler",
    policy_kwargs: {"policy": name, **its options}}."""

    def __init__(self, policy: str = "slo", **options: Any) -> None:
        self.policy = create(AutoscalingPolicy, policy, **options)
        self._last_target: int | None = None
        self._last_tick: float | None = None

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        now = ctx.current_time or time.time()
        target = ctx.target_num_replicas
        if self._last_target is not None and target > self._last_target:
            record_scale_up(ctx.app_name, ctx.deployment_name, self._last_tick or now, target)
        self._last_target, self._last_tick = target, now
        return self.policy.desired(signals_from(ctx, now)), {}


def signals_from(ctx: Any, now: float) -> ScalingSignals:
    """The policy's view of one tick: each running replica's newest samples."""
    raw: Mapping[str, Mapping[Any, list[Any]]] = ctx.raw_metrics or {}
    replicas: list[ReplicaSignals] = []
    for rid in ctx.running_replicas:
        newest = {name: (raw.get(name, {}).get(rid) or [None])[-1] for name in METRICS}
        ongoing, kv_usage = newest[ONGOING], newest[KV_USAGE]
        if ongoing is None or kv_usage is None:
            continue  # it has not reported yet
        replicas.append(
            ReplicaSignals(
                ongoing=ongoing.value,
                kv_usage=kv_usage.value,
                ttft_p95_interactive_s=_known(newest[TTFT_P95_INTERACTIVE]),
                ttft_p95_bulk_s=_known(newest[TTFT_P95_BULK]),
                age_s=max(0.0, now - ongoing.timestamp),
            )
        )
    queued = ctx.total_queued_requests or 0.0
    return ScalingSignals(
        current=ctx.current_num_replicas,
        target=ctx.target_num_replicas,
        replicas=replicas,
        queued=float(queued),
    )


def _known(sample: Any) -> float | None:
    return None if sample is None or sample.value < 0 else float(sample.value)


def _key(app: str | None, deployment: str) -> str:
    return f"scale_up:{app or ''}:{deployment}"


def record_scale_up(app: str | None, deployment: str, decided_at: float, target: int) -> None:
    """Keep the decision (wall-clock time, new target) among the deployment's last few."""
    try:
        decisions = _decisions(app, deployment)
        decisions.append({"decided_at": decided_at, "target": target})
        put_cluster_record(_key(app, deployment), json.dumps(decisions[-MAX_DECISIONS:]))
    except Exception as exc:  # cold-start timing must never disturb the autoscaler
        logger.warning("could not record a scale-up decision: %r", exc)


def scale_up_decided_before(app: str | None, deployment: str, started_at: float) -> float | None:
    """When the latest scale-up of `deployment` decided before `started_at` (wall clock,
    within the last 10 minutes) was made; None when there is none."""
    times = [d["decided_at"] for d in _decisions(app, deployment)]
    earlier = [t for t in times if started_at - 600.0 <= t <= started_at]
    return max(earlier, default=None)


def _decisions(app: str | None, deployment: str) -> list[dict[str, float]]:
    raw = cluster_record(_key(app, deployment))
    return list(json.loads(raw)) if raw else []
