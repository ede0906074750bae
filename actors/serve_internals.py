"""Every use of a private or undocumented Ray Serve API in firstlight, in one place.

Each helper says which Serve behaviour it relies on and why firstlight needs it, and
degrades to a safe no-op when a Serve version no longer has it; tests/actors/
test_serve_internals.py checks each one against the installed Serve (no Ray started) and
fails with a message naming the internal, so a Serve upgrade that changes one is caught by
the unit tests, not in production. Ray Serve version these were written against: 2.60.

Two are not code paths: `CONTROLLER_ENV_VARS` are the Serve variables `serve_config.yaml`
sets (read by `ray.serve._private.constants` when Serve's processes start), and
`bound_deployment` / `deployment_config` let tests check how a bound application is wired.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ray.serve import context as serve_context

# Serve environment variables serve_config.yaml sets for the proxy and the replicas (through
# `controller_options.runtime_env`), each read by `ray.serve._private.constants`:
# * RAY_SERVE_PROXY_USE_GRPC=1: the proxy forwards to the ingress over Serve's gRPC channel
#   instead of Ray actor calls;
# * RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0:
#   user code and the handle's router run on the process's main event loop (no thread hop
#   per chunk). Together ~15-20% less CPU per token in proxy and ingress (bench/overhead.py).
CONTROLLER_ENV_VARS = (
    "RAY_SERVE_PROXY_USE_GRPC",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
)


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


def bound_deployment(node: Any) -> Any:
    """The `Deployment` behind a bound `Application` (or an argument bound into one); other
    values pass through. Relies on `Application._bound_deployment` (Serve has no public
    accessor for a bound graph); used by tests that check how the app is wired."""
    return getattr(node, "_bound_deployment", node)


def deployment_config(deployment: Any) -> Any:
    """A `Deployment`'s full `DeploymentConfig` (autoscaling, request router, ...). Relies on
    `Deployment._deployment_config`; used by tests that check how the app is wired."""
    return deployment._deployment_config
