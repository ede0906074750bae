"""Every use of a private or undocumented Ray Serve API in firstlight, in one place.

Each helper says which Serve behaviour it relies on and why firstlight needs it, and
degrades to a safe no-op when a Serve version no longer has it; tests/actors/
test_serve_internals.py checks each one against the installed Serve (no Ray started) and
fails with a message naming the internal, so a Serve upgrade that changes one is caught by
the unit tests, not in production. Ray Serve version these were written against: 2.60.

Two are not code paths: `CONTROLLER_ENV_VARS` are the Serve variables `serve_config.yaml`
sets (read by `ray.serve._private.constants` when Serve's processes start; `with_ingress_port`
sets the ports among them), and
`bound_deployment` / `deployment_config` let tests check how a bound application is wired.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ray.serve import context as serve_context

from app.settings import SERVE_DIRECT_INGRESS, SERVE_DIRECT_PORT_MAX, SERVE_DIRECT_PORT_MIN

# Serve environment variables serve_config.yaml sets for the controller, the proxy and the
# replicas (through `controller_options.runtime_env`), each read by
# `ray.serve._private.constants`:
# * RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (part of Serve's "throughput optimized" mode): each
#   Ingress replica runs its own HTTP server and clients reach the app with no proxy hop.
#   Measured on 2 cores (bench/overhead.py, bench/admission.py): TTFT over bare mode 11.1 →
#   3.3 ms, and under a burst of 600 streams a refusal's 429 arrives in 0.5 s instead of 4 s
#   (the proxy → ingress hop took the requests in one by one behind the admitted streams'
#   tokens). Serve's proxy still serves `http_options.port` (head node only) as a fallback.
# * RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT / _MAX_HTTP_PORT: the Ingress replicas of one node
#   take the free ports of [MIN, MAX) in order (`with_ingress_port`); MIN is the port clients
#   use (`app.settings.serve_http_address`).
# * RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0: a stopping Ingress finishes its requests
#   but does not stay open the default 30 s for a load balancer that is not there.
# * RAY_SERVE_PORT_QUARANTINE_S=0: a restarted Ingress takes its port back as soon as the
#   old one has let it go (by default a freed port rests 150 s, and with one port in the
#   range the replacement could not start meanwhile).
# * RAY_SERVE_PROXY_USE_GRPC=1: the fallback proxy forwards to the ingress over Serve's gRPC
#   channel instead of Ray actor calls;
# * RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0:
#   user code and the handle's router run on the process's main event loop (no thread hop
#   per chunk). Together ~15-20% less CPU per token in proxy and ingress (bench/overhead.py).
# * RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S and
#   RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S: how often replicas push their
#   autoscaling stats and callers their queued requests to the controller (10 s by default,
#   which the autoscaler would add to every reaction, a scale-up from zero included).
CONTROLLER_ENV_VARS = (
    SERVE_DIRECT_INGRESS,
    SERVE_DIRECT_PORT_MIN,
    SERVE_DIRECT_PORT_MAX,
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
    "RAY_SERVE_PORT_QUARANTINE_S",
    "RAY_SERVE_PROXY_USE_GRPC",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
)


def with_ingress_port(
    controller_options: Mapping[str, Any] | None, port: int, replicas: int = 1
) -> dict[str, Any]:
    """`controller_options` (serve_config.yaml's) with Serve's direct ingress on and the
    Ingress replicas of a node on `port` and the next `replicas - 1` ports (the first one is
    where clients connect). Other ingress deployments (a second application) take the ports
    after the firstlight Ingress, in the order they are deployed.

    Relies on: the environment variables above, read by the controller (which hands out the
    ports) and the replicas. Used by tests, benchmarks and scripts that run Serve on ports of
    their own."""
    options = dict(controller_options or {})
    runtime_env = dict(options.get("runtime_env") or {})
    env = dict(runtime_env.get("env_vars") or {})
    env.update(
        {
            SERVE_DIRECT_INGRESS: "1",
            SERVE_DIRECT_PORT_MIN: str(port),
            SERVE_DIRECT_PORT_MAX: str(port + replicas),
        }
    )
    runtime_env["env_vars"] = env
    options["runtime_env"] = runtime_env
    return options


@contextlib.contextmanager
def own_serve_request_id() -> Iterator[None]:
    """Give the replica call made inside this block its own Serve-internal request id.

    Relies on: `ray.serve.context._serve_request_context`, a `ContextVar` holding a frozen
    dataclass `_RequestContext` with an `_internal_request_id` field, which every handle call
    made while serving one HTTP request inherits.

    Why: Serve's request router keeps pending calls in a dict keyed by that id, so when one
    HTTP request fans out (n > 1 choices) only the first pending call is indexed and, with any
    router but Serve's FIFO default, the others are never handed their replica (they hang).
    Outside Serve (no context) this does nothing.
    """
    var: Any = getattr(serve_context, "_serve_request_context", None)
    current: Any = var.get() if var is not None else None
    if current is None or not dataclasses.is_dataclass(current):
        yield
        return
    token = var.set(dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    try:
        yield
    finally:
        var.reset(token)


def serve_send_queue(send: Any) -> Callable[[], int] | None:
    """How many messages Serve's ASGI `send` has queued and its proxy not yet taken, as a
    callable; None when `send` is not Serve's (then no stall is ever reported).

    Relies on: the `send` Serve passes an ingress's ASGI app (`enqueue`, defined inside
    `UserCallableWrapper.call_http_entrypoint` in `ray.serve._private.replica`) is a closure
    over a `ray.serve._private.http_util.MessageQueue`, which keeps the unsent messages in a
    `collections.deque` attribute `_message_queue` that the proxy side drains from the left.

    Why: Serve's `send` never blocks (it only queues), so a client that stops reading would
    never be noticed; the age of the oldest unsent message is how the SSE writer cuts it.
    """
    for cell in getattr(send, "__closure__", None) or ():
        try:
            queue = getattr(cell.cell_contents, "_message_queue", None)
        except ValueError:  # an empty cell
            continue
        if isinstance(queue, deque):
            return queue.__len__
    return None


def replica_queue_lengths(router: Any) -> Callable[[Any], int | None]:
    """`get(replica_id)`: the queue length Serve's router last saw for a replica, or None
    when it has none fresh.

    Relies on: `ray.serve.request_router.RequestRouter` keeping its probed queue lengths in
    `replica_queue_len_cache` (backed by `_replica_queue_len_cache`), a
    `ReplicaQueueLengthCache` whose `get(ReplicaID)` returns an int or None. Custom routers'
    docs use it, but it is not part of the documented router API.

    Why: routing policies weigh replicas by load; these lengths are free (Serve keeps them
    fresh from its probes and replies) where asking the replicas would cost a round trip.
    """
    cache = getattr(router, "replica_queue_len_cache", None)
    if cache is None:
        cache = getattr(router, "_replica_queue_len_cache", None)
    get = getattr(cache, "get", None)
    return get if callable(get) else _unknown


def _unknown(replica_id: Any) -> None:
    return None


def router_app_name(router: Any) -> str | None:
    """The application of the deployment a request router routes to (None: unknown).

    Relies on: `RequestRouter.__init__` keeping its `deployment_id` argument (a `DeploymentID`
    with an `app_name`) as `_deployment_id`; the router API has no public accessor.

    Why: the router follows the replicas' prefix sketches from the ControlPlane deployment of
    the same application, and may run outside any Serve replica (a driver's handle), where
    the replica context cannot name the application."""
    deployment_id = getattr(router, "_deployment_id", None)
    app_name = getattr(deployment_id, "app_name", None)
    return app_name if isinstance(app_name, str) else None


def bound_deployment(node: Any) -> Any:
    """The `Deployment` behind a bound `Application` (or an argument bound into one); other
    values pass through. Relies on `Application._bound_deployment` (Serve has no public
    accessor for a bound graph); used by tests that check how the app is wired."""
    return getattr(node, "_bound_deployment", node)


def deployment_config(deployment: Any) -> Any:
    """A `Deployment`'s full `DeploymentConfig` (autoscaling, request router, ...). Relies on
    `Deployment._deployment_config`; used by tests that check how the app is wired."""
    return deployment._deployment_config


_RECORD_NAMESPACE = "firstlight"


def put_cluster_record(key: str, value: str) -> None:
    """Store `value` under `key` in the Ray cluster's key-value store (the GCS), readable from
    every process of the cluster. A blocking call of a few ms: call it rarely (a scale-up
    decision), never per request.

    Relies on: `ray.experimental.internal_kv._internal_kv_put(key, value, overwrite,
    namespace)`, Ray's private KV client (Serve keeps its own checkpoints there).

    Why: the autoscaler runs inside Serve's controller, which firstlight's actors cannot
    call; this is how a new replica learns when the decision that started it was made."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        key.encode(), value.encode(), overwrite=True, namespace=_RECORD_NAMESPACE
    )


def cluster_record(key: str) -> str | None:
    """What `put_cluster_record` stored under `key` (None: nothing, or no Ray here)."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(key.encode(), namespace=_RECORD_NAMESPACE)
    return raw.decode() if raw else None


def stop_router_loop() -> bool:
    """Stop the event loop that Serve's handles share in a driver process
    (`SingletonThreadRouter`'s loop on a daemon thread: the routers' long-poll clients,
    metrics pushes and its `EventLoopMonitor`), and forget it, so a handle made later starts a
    new one. Call it after `serve.shutdown()` and before `ray.shutdown()` in a process that goes
    on without Ray: anything on that loop that reaches Ray after the shutdown ends the process
    with status 1 ("The core worker has already been shutdown ... The process will exit"),
    which is how the test run, which shuts Ray down between modules, died in CI after a module
    that used handles in its own process. Returns whether there was a loop to stop."""
    try:
        from ray.serve._private.router import SingletonThreadRouter
    except ImportError:
        return False
    with SingletonThreadRouter._asyncio_loop_creation_lock:
        loop = getattr(SingletonThreadRouter, "_asyncio_loop", None)
        monitor = getattr(SingletonThreadRouter, "_event_loop_monitor", None)
        if loop is None:
            return False
        if loop.is_running():

            def stop() -> None:  # on the loop's own thread
                if monitor is not None and hasattr(monitor, "stop"):
                    monitor.stop()
                loop.stop()

            loop.call_soon_threadsafe(stop)
            deadline = time.monotonic() + 5
            while loop.is_running() and time.monotonic() < deadline:
                time.sleep(0.01)  # run_forever returns after the iteration that ran `stop`
        SingletonThreadRouter._asyncio_loop = None
        SingletonThreadRouter._event_loop_monitor = None
    return True
