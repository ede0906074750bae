"""ReplicaClient: an `EngineClient` that streams from the ModelReplica deployment.

The app (app/) sees the same contract as in bare mode: `generate(request)` is an async
iterator of `TokenDelta`s that raises `ValueError` (400), `QueueFull` (429) or
`Unavailable` (503) before the first delta, and closing it early aborts the
request. Each delta crosses exactly one actor hop (replica → this process), by one of two
paths:
* with a `ChannelServer` (`ingress.token_path: channel`, the default): the request is one
  unary Serve call (`ModelReplica.stream_to`) and its deltas arrive on the token channel
  (actors/token_channel.py) in the request's inbox, which merges them while this side lags.
  The call's outcome ends the stream on failure; when it succeeds, the last delta is already
  on the socket and must arrive within `final_delta_grace_s`;
* without one (`stream`): each delta is an item of a Serve streaming call (`generate`).

Bulk requests that want their output whole (batch lines, non-streamed `flex` requests) and
start in the same event-loop pass share one Serve call (`ModelReplica.stream_group`, at
most `group_max` of them; one replica serves them all): a replica handles each Serve call
with a fixed cost on the event loop its engine thread shares the GIL with, and a batch
starts its lines in bunches. Each request still gets its own deltas, its own outcome and
its own place in `check_admission`; a refusal of one of them reaches it when the call ends.
One that is left early (its reader gone, or `abort`) runs on at the replica until every
request of its call has ended or been left; then the call is cancelled, and the replica
aborts what still runs.

Translation of what can go wrong across the hop:
* a `ReplicaError` item (the replica refused the request) → the exception it names;
* Serve's `BackPressureError` (every replica at `max_ongoing_requests` and the handle's own
  queue full) → `QueueFull`;
* no replica to route to, or the replica died → `Unavailable` (a 503 before the
  first token; an SSE error event after it);
* any other remote failure → `RuntimeError` (a 500, logged by the app).

`admit(request)`, called before anything is sent, lets the ingress refuse early from its
local cluster-view cache (never a remote call). A `BulkGate` (actors/bulk_gate.py), when
given, then holds a bulk request until the cluster has spare capacity for it; a held stream
gets SSE keepalives like any other wait for a first token.

Any deployment (the Ingress, a batch-jobs deployment, a draft-model caller) builds its client
with `await ReplicaClient.connect(handle, settings)`, which starts the client's own
`ChannelServer` when the token path is the channel, and releases it with `await close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from actors.bulk_gate import BulkGate
from actors.messages import ReplicaError
from actors.runtime import node_id, node_ip, replica_id
from actors.serve_internals import own_serve_request_id
from actors.settings import IngressSettings
from actors.token_channel import ChannelServer, TokenInbox
from engine.errors import QueueFull, Unavailable
from engine.request import Request, RequestClass, TokenDelta, clock_base
from engine.stats import EngineStats, sum_engine_stats

BULK = RequestClass.BULK

_UNAVAILABLE = (
    ActorDiedError,
    ActorUnavailableError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)


class ReplicaClient:
    def __init__(
        self,
        handle: DeploymentHandle,
        *,
        channel: ChannelServer | None = None,
        admit: Callable[[Request], None] | None = None,
        stats: Callable[[], EngineStats] | None = None,
        retry_after: Callable[[RequestClass], float] | None = None,
        capacity: Callable[[RequestClass, int, int], None] | None = None,
        gate: BulkGate | None = None,
        transport: dict[str, Any] | None = None,
        final_delta_grace_s: float = 10.0,
        reserve_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        group_max: int = 1,
    ) -> None:
        self.gate = gate
        self._stream = handle.options(stream=True, **(transport or {}))
        self._unary = handle.options(**(transport or {})) if channel is not None else None
        self._channel = channel
        self._admit = admit
        self._stats = stats
        self._retry_after = retry_after
        self._capacity = capacity
        self._grace_s = final_delta_grace_s
        self._inflight: dict[str, Any] = {}  # request id → the Serve call's response
        # When each request admitted by `check_admission` passed it, until it starts (its
        # `generate`): between the two it tokenizes, and a burst's requests all pass the check
        # before the first one starts, so they count as in flight from the check on.
        self._reserved: deque[float] = deque()
        self._reserve_s = reserve_s
        self._clock = clock
        self._owned_channel: ChannelServer | None = None  # started by `connect`
        self._group_max = group_max
        self._group: _Group | None = None  # bulk whole-output requests of this loop pass

    @classmethod
    async def connect(
        cls,
        handle: DeploymentHandle,
        settings: IngressSettings,
        *,
        owner_id: str | None = None,
        admit: Callable[[Request], None] | None = None,
        stats: Callable[[], EngineStats] | None = None,
        retry_after: Callable[[RequestClass], float] | None = None,
        capacity: Callable[[RequestClass, int, int], None] | None = None,
        gate: BulkGate | None = None,
    ) -> ReplicaClient:
        """A client of `handle` (a ModelReplica deployment) for the calling process, built from
        `settings` (`token_path`, `channel_tcp_host`, `transport`). With the channel token
        path it starts a `ChannelServer` of its own, named `owner_id` (default: this Serve
        replica's id) and stopped by `close()`; call `close()` in every case."""
        channel: ChannelServer | None = None
        if settings.token_path == "channel":
            channel = ChannelServer()
            host = settings.channel_tcp_host
            await channel.start(
                ingress_id=owner_id or replica_id(),
                node_id=node_id(),
                tcp_host={"auto": node_ip(), "off": None}.get(host, host),
            )
        client = cls(
            handle,
            channel=channel,
            admit=admit,
            stats=stats,
            retry_after=retry_after,
            capacity=capacity,
            gate=gate,
            transport=settings.handle_options(),
            group_max=settings.bulk_group_max,
        )
        client._owned_channel = channel
        return client

    @property
    def channel(self) -> ChannelServer | None:
        """The token channel deltas arrive on (None: the stream token path)."""
        return self._channel

    async def close(self) -> None:
        """Stop the channel `connect` started; call it once no request is in flight."""
        channel, self._owned_channel = self._owned_channel, None
        if channel is not None:
            await channel.stop()

    def generate(self, request: Request) -> AsyncIterator[TokenDelta]:
        if self._channel is not None:
            return self._via_channel(request, self._channel)
        return self._via_stream(request)

    @contextlib.asynccontextmanager
    async def _admitted(self, request: Request) -> AsyncIterator[None]:
        """The early admission check, then (bulk) a place at the gate, held until the request
        ends. A place `check_admission` reserved is given back: from here the request counts
        in flight itself (bulk: once past the gate, which bounds its own waiters)."""
        if self._reserved:
            self._reserved.popleft()
        if self._admit is not None:
            self._admit(request)
        gated = self.gate is not None and await self.gate.acquire(request.request_class)
        try:
            yield
        finally:
            if gated:
                assert self.gate is not None
                self.gate.release()

    async def _via_channel(
        self, request: Request, channel: ChannelServer
    ) -> AsyncIterator[TokenDelta]:
        async with self._admitted(request):
            rid = request.request_id
            inbox = channel.open(rid)
            assert self._unary is not None and channel.address is not None
            request.sender_clock = clock_base()
            response: Any
            if self._group_max > 1 and request.whole_output and request.request_class is BULK:
                response = self._join_group(request)
                call = response.outcome
            else:
                with own_serve_request_id():
                    response = self._unary.stream_to.remote(request, channel.address)
                retry_after_s = self._backpressure_retry_s(request)
                call = asyncio.ensure_future(_outcome(response, retry_after_s))
            self._inflight[rid] = response
            call.add_done_callback(functools.partial(self._call_done, inbox, rid))
            finished = False
            try:
                while True:
                    delta = await inbox.get()
                    finished = delta.finish_reason is not None
                    yield delta
                    if finished:
                        return
            finally:
                self._inflight.pop(rid, None)
                channel.close(rid)
                if isinstance(response, _Member):
                    response.leave(finished)
                elif not finished and not call.done():
                    # The replica sees CancelledError and aborts the request. Serve's cancel()
                    # re-raises a failed assignment's error (e.g. BackPressureError): not ours.
                    with contextlib.suppress(Exception):
                        response.cancel()

    def _join_group(self, request: Request) -> _Member:
        """A place for `request` in the group of this loop pass, sent at the end of the pass
        (or once it holds `group_max` requests)."""
        group = self._group
        if group is None:
            group = self._group = _Group()
            asyncio.get_running_loop().call_soon(self._send_group, group)
        member = group.add(request)
        if len(group.members) >= self._group_max:
            self._send_group(group)
        return member

    def _send_group(self, group: _Group) -> None:
        if self._group is group:
            self._group = None
        if group.sent:  # it filled up and went at once
            return
        group.sent = True
        members = [m for m in group.members if not m.left]
        if not members:
            return
        requests = [m.request for m in members]
        retry_after_s = None
        try:
            assert self._unary is not None and self._channel is not None
            retry_after_s = self._backpressure_retry_s(requests[0])
            with own_serve_request_id():
                group.response = self._unary.stream_group.remote(requests, self._channel.address)
        except Exception as exc:  # (run from the loop: raised here it would reach nobody)
            error = _translate(exc, retry_after_s)
            for member in members:
                member.outcome.set_exception(error)
            return
        outcome = asyncio.ensure_future(_outcome(group.response, retry_after_s))
        outcome.add_done_callback(functools.partial(_settle, members))

    def _call_done(self, inbox: TokenInbox, rid: str, call: asyncio.Future[Any]) -> None:
        if call.cancelled():
            return
        error = call.exception()  # retrieved even when no reader is left (else asyncio logs it)
        if inbox.closed:
            return
        if error is not None:
            inbox.fail(error)
        elif isinstance(result := call.result(), ReplicaError):
            inbox.fail(result.exception())
        else:  # done: the last delta is on its way over the channel
            inbox.fail_later(
                self._grace_s, RuntimeError(f"replica finished {rid} but its last delta never came")
            )

    async def _via_stream(self, request: Request) -> AsyncIterator[TokenDelta]:
        async with self._admitted(request):
            request.sender_clock = clock_base()
            with own_serve_request_id():
                response = self._stream.generate.remote(request)
            rid = request.request_id
            self._inflight[rid] = response
            finished = False
            try:
                async for item in response:
                    if isinstance(item, ReplicaError):
                        finished = True  # the replica's call is over: nothing to cancel
                        raise item.exception()
                    finished = item.finish_reason is not None
                    yield item
                    if finished:
                        return
                raise RuntimeError(f"replica stream of {rid} ended before its last delta")
            except Exception as exc:
                raise _translate(exc, self._backpressure_retry_s(request)) from None
            finally:
                self._inflight.pop(rid, None)
                if not finished:
                    with contextlib.suppress(Exception):
                        response.cancel()

    async def abort(self, request_id: str) -> None:
        response = self._inflight.get(request_id)
        if response is not None:
            with contextlib.suppress(Exception):
                response.cancel()

    def stats(self) -> EngineStats:
        """Replica stats summed from the ingress's cached cluster view (may be ~1 s old)."""
        return self._stats() if self._stats is not None else sum_engine_stats("", [])

    def check_admission(self, request_class: RequestClass, count: int) -> None:
        """`EngineClient.check_admission`: `capacity(request_class, count, in_flight)` with
        this client's requests in flight (the ingress's `ClusterCache.check_capacity`),
        counting those admitted here that have not started yet. An admitted request holds
        its place until it starts, until `release_admission` (one that fails before it
        starts, on a bad prompt say), or for `reserve_s` at most."""
        if self._capacity is None:
            return
        reserved, now = self._reserved, self._clock()
        while reserved and reserved[0] <= now - self._reserve_s:
            reserved.popleft()
        self._capacity(request_class, count, len(self._inflight) + len(reserved))
        reserved.extend([now] * count)

    def release_admission(self, count: int) -> None:
        """`EngineClient.release_admission`: the newest `count` places are given back."""
        for _ in range(min(count, len(self._reserved))):
            self._reserved.pop()

    def _backpressure_retry_s(self, request: Request) -> float | None:
        """The Retry-After for a refusal by Serve's own queue: the engine's rule, from the
        cluster view (`retry_after`), so a client sees one rule whichever layer refused."""
        return None if self._retry_after is None else self._retry_after(request.request_class)


class _Member:
    """One request's place in a `_Group`; `outcome` resolves as a call of its own would
    (its `ReplicaError`, None, or the call's failure)."""

    __slots__ = ("group", "left", "outcome", "request")

    def __init__(self, group: _Group, request: Request) -> None:
        self.group = group
        self.request = request
        self.left = False
        self.outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def leave(self, finished: bool) -> None:
        """Its reader is done with it (`finished`: it got its last delta). Once every member
        has left and one of them unfinished, the call is cancelled: the replica aborts the
        requests still running."""
        if self.left:
            return
        self.left = True
        group = self.group
        group.abandoned |= not finished
        if group.response is not None and group.abandoned and all(m.left for m in group.members):
            # Serve's cancel() re-raises a failed assignment's error: not ours.
            with contextlib.suppress(Exception):
                group.response.cancel()

    def cancel(self) -> None:
        """`ReplicaClient.abort`: leave unfinished."""
        self.leave(finished=False)


class _Group:
    """Bulk whole-output requests sent in one `ModelReplica.stream_group` call."""

    __slots__ = ("abandoned", "members", "response", "sent")

    def __init__(self) -> None:
        self.members: list[_Member] = []
        self.sent = False
        self.response: Any = None  # the Serve call, once sent (None: refused at once)
        self.abandoned = False  # a member left before its last delta

    def add(self, request: Request) -> _Member:
        member = _Member(self, request)
        self.members.append(member)
        return member


def _settle(members: list[_Member], call: asyncio.Future[Any]) -> None:
    """Each member's outcome from its group call's: its own item, or the call's failure."""
    error = None if call.cancelled() else call.exception()
    results = None if error is not None or call.cancelled() else call.result()
    for i, member in enumerate(members):
        if member.outcome.done():
            continue
        if call.cancelled():
            member.outcome.cancel()
        elif error is not None:
            member.outcome.set_exception(error)
        else:
            member.outcome.set_result(results[i])


async def _outcome(response: Any, retry_after_s: float | None) -> Any:
    """The result of a unary replica call, with Serve and Ray failures translated."""
    try:
        return await response
    except Exception as exc:
        raise _translate(exc, retry_after_s) from None


def _translate(exc: Exception, retry_after_s: float | None = None) -> Exception:
    """Serve / Ray failures of a replica call as the engine's own exceptions. A refusal by
    Serve's queue (a last resort: replicas take more calls than their engine admits, so the
    engine refuses first) carries `retry_after_s` when the caller knows the engine's rule."""
    if isinstance(exc, BackPressureError):
        return QueueFull(
            "every model replica is busy", retry_after_s=retry_after_s or exc.retry_after_s or 1.0
        )
    if isinstance(exc, _UNAVAILABLE):
        return Unavailable(f"model replica unavailable: {exc}")
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, _UNAVAILABLE):
            return Unavailable(f"model replica unavailable: {cause}")
        return RuntimeError(f"model replica failed: {cause!r}")
    return exc
