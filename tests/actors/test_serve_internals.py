"""The Ray Serve internals firstlight relies on (actors/serve_internals.py), checked against
the installed Serve without starting Ray. A failure here means a Serve upgrade changed one:
the message names it; fix its helper in actors/serve_internals.py, not the test.

What only a live Serve shows, and test_serve_app.py / test_routing_serve.py (the `serve`
tests) cover end to end: that the ASGI `send` Serve hands the ingress really is the
`enqueue` closure checked below (a stalled reader is cut), and that Serve's router indexes
pending calls by internal request id (n > 1 fan-out under prefix_affinity completes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import types
from collections import deque
from pathlib import Path

import pytest
import yaml
from ray import serve
from ray.serve import context as serve_context

from actors import serve_internals
from actors.serve_internals import (
    CONTROLLER_ENV_VARS,
    bound_deployment,
    deployment_config,
    own_serve_request_id,
    replica_queue_lengths,
    router_app_name,
    serve_send_queue,
    with_ingress_port,
)
from app.settings import serve_http_address

ROOT = Path(__file__).resolve().parents[2]


def need(condition: object, internal: str, what: str) -> None:
    if not condition:
        pytest.fail(f"Ray Serve internal {internal} changed: {what}", pytrace=False)


# -- own_serve_request_id ----------------------------------------------------------------------


def test_serve_request_context_var_and_its_internal_request_id():
    var = getattr(serve_context, "_serve_request_context", None)
    need(
        hasattr(var, "get") and hasattr(var, "set") and hasattr(var, "reset"),
        "ray.serve.context._serve_request_context",
        "no longer a ContextVar",
    )
    cls = getattr(serve_context, "_RequestContext", None)
    need(dataclasses.is_dataclass(cls), "ray.serve.context._RequestContext", "not a dataclass")
    names = {f.name for f in dataclasses.fields(cls)}
    need(
        {"_internal_request_id", "request_id"} <= names,
        "ray.serve.context._RequestContext._internal_request_id",
        f"fields are now {sorted(names)}",
    )


def test_a_handle_call_inside_the_block_gets_its_own_internal_id():
    """Serve's handle builds each call's metadata from the context: inside the block that
    metadata carries a fresh internal id and the user-visible request id."""
    from ray.serve._private.default_impl import get_request_metadata
    from ray.serve._private.handle_options import DynamicHandleOptions, InitHandleOptions

    parent = serve_context._RequestContext(request_id="http-1", _internal_request_id="parent")
    token = serve_context._serve_request_context.set(parent)
    try:
        seen = []
        for _ in range(2):
            with own_serve_request_id():
                meta = get_request_metadata(
                    InitHandleOptions.create(), DynamicHandleOptions(method_name="generate")
                )
                seen.append(meta)
        need(
            all(m.request_id == "http-1" for m in seen),
            "ray.serve._private.default_impl.get_request_metadata",
            "no longer copies the context's request_id",
        )
        ids = {m.internal_request_id for m in seen}
        need(
            len(ids) == 2 and "parent" not in ids,
            "ray.serve._private.default_impl.get_request_metadata",
            "no longer takes internal_request_id from _RequestContext._internal_request_id",
        )
        assert serve_context._get_serve_request_context() is parent  # restored after each
    finally:
        serve_context._serve_request_context.reset(token)


def test_outside_serve_the_block_changes_nothing():
    # The driver's context may hold Serve's default context once a Serve app ran in-process.
    before = serve_context._serve_request_context.get()
    with own_serve_request_id():
        pass
    assert serve_context._serve_request_context.get() is before


# -- serve_send_queue ----------------------------------------------------------------------


def _nested_code(func: object, name: str) -> list[types.CodeType]:
    code = func.__code__  # type: ignore[attr-defined]
    return [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name]


def test_serves_asgi_send_is_a_closure_over_its_message_queue():
    from ray.serve._private.replica import UserCallableWrapper

    entry = getattr(UserCallableWrapper, "call_http_entrypoint", None)
    internal = "ray.serve._private.replica.UserCallableWrapper.call_http_entrypoint"
    need(entry is not None, internal, "is gone")
    enqueues = _nested_code(entry, "enqueue")
    need(enqueues, internal, "no longer defines the `enqueue` send closure")
    for code in enqueues:
        need(
            "result_queue" in code.co_freevars,
            internal,
            f"`enqueue` no longer closes over result_queue (free vars {code.co_freevars})",
        )
    need(
        "MessageQueue" in entry.__code__.co_names,
        internal,
        "result_queue is no longer an http_util.MessageQueue",
    )


async def test_message_queue_keeps_unsent_messages_in_a_deque():
    from ray.serve._private.http_util import MessageQueue

    internal = "ray.serve._private.http_util.MessageQueue._message_queue"
    result_queue = MessageQueue()
    need(isinstance(getattr(result_queue, "_message_queue", None), deque), internal, "gone")

    async def enqueue(item: object) -> None:  # as Serve's, with user code on its loop
        result_queue.put_nowait(item)

    pending = serve_send_queue(enqueue)
    need(pending is not None, internal, "not found through the send closure")
    assert pending is not None
    await enqueue({"type": "http.response.start"})
    await enqueue({"type": "http.response.body"})
    need(pending() == 2, internal, "put_nowait no longer appends to it")
    await asyncio.wait_for(result_queue.get_one_message(), 1)
    need(pending() == 1, internal, "get_one_message no longer takes from it")


# -- replica_queue_lengths -----------------------------------------------------------------


def test_request_routers_queue_length_cache():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache
    from ray.serve.request_router import RequestRouter

    internal = "ray.serve.request_router.RequestRouter.replica_queue_len_cache"
    need(
        isinstance(getattr(RequestRouter, "replica_queue_len_cache", None), property),
        internal,
        "gone",
    )
    need(
        "self._replica_queue_len_cache = ReplicaQueueLengthCache("
        in inspect.getsource(RequestRouter.__init__),
        internal,
        "no longer a ReplicaQueueLengthCache built by the router",
    )
    params = list(inspect.signature(ReplicaQueueLengthCache.get).parameters)
    need(params == ["self", "replica_id"], f"{internal}.get", f"signature is now {params}")

    cache = ReplicaQueueLengthCache()
    rid = ReplicaID("r1", DeploymentID(name="ModelReplica", app_name="firstlight"))
    cache.update(rid, 3)
    router = types.SimpleNamespace(replica_queue_len_cache=cache)
    get = replica_queue_lengths(router)
    assert get(rid) == 3
    assert get(ReplicaID("r2", rid.deployment_id)) is None


def test_without_a_cache_every_queue_length_is_unknown():
    assert replica_queue_lengths(object())("anything") is None


# -- controller environment variables --------------------------------------------------------


def test_the_serve_env_vars_serve_config_sets_are_read_by_serve():
    from ray.serve._private import constants

    source = inspect.getsource(constants)
    for name in CONTROLLER_ENV_VARS:
        need(
            hasattr(constants, name) and f'"{name}"' in source,
            f"ray.serve._private.constants.{name}",
            "is no longer read by Serve",
        )
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    env = config["controller_options"]["runtime_env"]["env_vars"]
    assert set(env) == set(CONTROLLER_ENV_VARS)  # each documented in serve_internals


def test_serve_hands_ingress_ports_from_the_range_the_env_vars_set():
    """Serve's controller allocates a direct-ingress replica's port from [MIN, MAX) of the
    environment it started with; serve_config.yaml's MIN is the port clients use."""
    from ray.serve._private import constants
    from ray.serve._private.node_port_manager import PortAllocator

    need(
        {"RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"}
        <= set(vars(constants)),
        "ray.serve._private.constants direct-ingress settings",
        "are gone",
    )
    allocator = PortAllocator(18123, 18125, "HTTP", "node")
    need(
        [allocator.allocate(f"replica-{i}") for i in range(2)] == [18123, 18124],
        "ray.serve._private.node_port_manager.PortAllocator",
        "no longer hands out the lowest free port first",
    )
    with pytest.raises(Exception, match="No available ports"):  # MAX is excluded
        allocator.allocate("replica-2")
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert serve_http_address(config) == {"host": "127.0.0.1", "port": 8000}
    assert config["http_options"]["port"] != 8000  # Serve's proxy: the fallback


def test_with_ingress_port_sets_the_range_and_keeps_the_rest():
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["controller_options"]
    options = with_ingress_port(shipped, 18123, replicas=2)
    env = options["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "18123"
    assert env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "18125"  # exclusive: two ports
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert {k: v for k, v in env.items() if "_HTTP_PORT" not in k} == {
        k: v for k, v in shipped["runtime_env"]["env_vars"].items() if "_HTTP_PORT" not in k
    }
    assert shipped["runtime_env"]["env_vars"]["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8000"
    bare = with_ingress_port(None, 9000)["runtime_env"]["env_vars"]
    assert bare["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "9001"


# -- bound applications (tests) ---------------------------------------------------------------


def test_a_bound_application_exposes_its_deployment_and_config():
    @serve.deployment(name="Probe", max_ongoing_requests=7)
    class Probe:
        def __init__(self, x: int) -> None:
            self.x = x

    app = Probe.bind(1)
    deployment = bound_deployment(app)
    need(getattr(deployment, "name", None) == "Probe", "Application._bound_deployment", "gone")
    config = deployment_config(deployment)
    need(
        getattr(config, "max_ongoing_requests", None) == 7,
        "Deployment._deployment_config",
        "gone",
    )
    assert bound_deployment(5) == 5


def test_every_helper_is_covered_here():
    """A new helper in serve_internals needs its own check above."""
    helpers = {
        name
        for name, value in vars(serve_internals).items()
        if inspect.isfunction(value)
        and value.__module__ == serve_internals.__name__
        and not name.startswith("_")
    }
    assert helpers == {
        "own_serve_request_id",
        "serve_send_queue",
        "replica_queue_lengths",
        "bound_deployment",
        "deployment_config",
        "put_cluster_record",
        "cluster_record",
        "router_app_name",
        "with_ingress_port",
        "stop_router_loop",
    }


# -- put_cluster_record / cluster_record --------------------------------------------------------


def test_ray_internal_kv_put_and_get_take_a_namespace():
    from ray.experimental import internal_kv

    for name in ("_internal_kv_put", "_internal_kv_get", "_internal_kv_initialized"):
        need(callable(getattr(internal_kv, name, None)), f"ray.experimental.internal_kv.{name}",
             "is gone")  # fmt: skip
    for name in ("_internal_kv_put", "_internal_kv_get"):
        params = inspect.signature(getattr(internal_kv, name)).parameters
        need("namespace" in params, f"ray.experimental.internal_kv.{name}",
             f"takes no namespace (parameters: {list(params)})")  # fmt: skip
    need("overwrite" in inspect.signature(internal_kv._internal_kv_put).parameters,
         "ray.experimental.internal_kv._internal_kv_put", "takes no overwrite flag")  # fmt: skip


# -- router_app_name ----------------------------------------------------------------------------


def test_a_request_router_keeps_its_deployment_id():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve.request_router import RequestRouter

    class Probe(RequestRouter):
        async def choose_replicas(self, candidate_replicas, pending_request=None):
            return []

    router = Probe(
        DeploymentID(name="ModelReplica", app_name="app1"), DeploymentHandleSource.UNKNOWN
    )
    need(router_app_name(router) == "app1", "RequestRouter._deployment_id", "gone or renamed")


def test_stop_router_loop_stops_and_forgets_the_handles_loop(monkeypatch):
    import threading

    from ray.serve._private.event_loop_monitoring import EventLoopMonitor
    from ray.serve._private.router import SingletonThreadRouter

    for name in ("_asyncio_loop", "_event_loop_monitor", "_asyncio_loop_creation_lock"):
        need(hasattr(SingletonThreadRouter, name), f"SingletonThreadRouter.{name}", "is gone")
    need(callable(getattr(EventLoopMonitor, "stop", None)), "EventLoopMonitor.stop", "is gone")

    # A loop on a daemon thread with a periodic task, as Serve's router loop has.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.01)

    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)  # it runs
    ticking = asyncio.run_coroutine_threadsafe(tick(), loop)
    stopped_on: list[threading.Thread] = []

    class Monitor:
        def stop(self) -> None:
            stopped_on.append(threading.current_thread())
            ticking.cancel()

    monkeypatch.setattr(SingletonThreadRouter, "_asyncio_loop", loop)
    monkeypatch.setattr(SingletonThreadRouter, "_event_loop_monitor", Monitor())
    try:
        assert serve_internals.stop_router_loop()
        thread.join(5)
        assert not thread.is_alive() and not loop.is_running()
        assert stopped_on == [thread]  # the monitor is stopped on the loop's own thread
        assert SingletonThreadRouter._asyncio_loop is None  # a later handle makes a new one
        assert SingletonThreadRouter._event_loop_monitor is None
    finally:
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    assert not serve_internals.stop_router_loop()  # no loop: nothing to stop


def test_routing_logs_outside_a_serve_replica_changes_nothing() -> None:
    """A deployment class built outside Serve (in a test) leaves the project's loggers as
    they were: still propagating to the root, where pytest's capture and bare mode's
    handler listen."""
    import logging

    from actors.runtime import OUR_LOGGERS, route_logs

    before = [
        (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in OUR_LOGGERS
    ]
    route_logs()
    after = [
        (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in OUR_LOGGERS
    ]
    assert after == before and all(propagate for _, propagate in after)
