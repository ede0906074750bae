"""The token channel: the replica → ingress hop as one socket per (replica, ingress) pair.

Why: through a Serve stream every token of every request is its own item, and on a small
CPU box Serve's per-item machinery (serialize, gRPC write, wrapper generators, deserialize)
costs more than the model's own step and competes with the engine thread for the GIL. Here
the replica writes, after each engine step, ONE frame to each ingress holding the deltas of
all of that ingress's requests; the ingress parses it in one callback and drops each delta
into its request's inbox. Measured by bench/overhead.py (see bench/RESULTS.md).

What stays with Serve: each request is still one Serve call (`ModelReplica.stream_to`,
routed, counted by `max_ongoing_requests` and the autoscaler, cancelled when the client
leaves); that call returns once the request's last delta is on the socket, or returns a
`ReplicaError` when the engine refuses the request. Tokens still cross exactly one actor hop.

Transport: a Unix socket when both ends are on the same node, else TCP to the ingress's node
(two raylets on one host are two nodes: TCP). Each side says which it took: the ingress
counts accepted connections by transport (`firstlight_token_channel_connections_total`
in `/metrics`), the replica logs each connection it opens (INFO).
A replica opens each connection by sending the ingress's random secret (it travels in the
`ChannelAddress` of every request, over Serve); the ingress drops any connection that does
not, so nobody else can inject tokens into a stream. Frames are a 4-byte length and a JSON
list of plain values per delta (`encode_delta`): never pickle, which would let a peer run
code in the ingress.

Backpressure: a replica-side `ChannelSlot` holds at most one (merged) delta per request;
when the ingress stops reading and the socket's buffers fill, the transport pauses writing
and new deltas merge in their slots (memory bounded by the requests' own outputs) until it
resumes. The engine's stall cut applies to these slots like to any reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from app.metric_snapshot import PREFIX, Snapshot
from engine.async_engine import OutputSlot
from engine.errors import InvalidRequest
from engine.request import FinishReason, Timings, TokenDelta, TokenLogprob

logger = logging.getLogger("firstlight.channel")

_HEADER = struct.Struct("!I")
TRANSPORTS = ("unix", "tcp")
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a corrupt length must not make the reader allocate GiBs
CONNECT_TIMEOUT_S = 10.0


# -- wire format ---------------------------------------------------------------------------------


def encode_delta(delta: TokenDelta) -> tuple[Any, ...]:
    """A `TokenDelta` as plain JSON-able values."""
    t = delta.timings
    return (
        delta.request_id,
        delta.token_ids,
        delta.text,
        None if delta.finish_reason is None else str(delta.finish_reason),
        None
        if delta.logprobs is None
        else [(lp.token_id, lp.logprob, lp.top) for lp in delta.logprobs],
        delta.num_prompt_tokens,
        delta.num_output_tokens,
        delta.num_cached_tokens,
        None if t is None else (t.arrival, t.first_scheduled, t.first_token, t.finished),
        delta.error,
        delta.num_draft_tokens,
        delta.num_accepted_tokens,
    )


def decode_delta(item: tuple[Any, ...]) -> TokenDelta:
    rid, ids, text, finish, logprobs, n_prompt, n_out, n_cached, timings, error, n_draft, n_ok = (
        item
    )
    return TokenDelta(
        request_id=rid,
        token_ids=ids,
        text=text,
        finish_reason=None if finish is None else FinishReason(finish),
        logprobs=None
        if logprobs is None
        else [TokenLogprob(i, lp, [(t, v) for t, v in top]) for i, lp, top in logprobs],
        num_prompt_tokens=n_prompt,
        num_output_tokens=n_out,
        num_cached_tokens=n_cached,
        timings=None if timings is None else Timings(*timings),
        error=error,
        num_draft_tokens=n_draft,
        num_accepted_tokens=n_ok,
    )


_encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def frame(items: list[tuple[Any, ...]]) -> bytes:
    payload = _encode_json(items).encode()
    return _HEADER.pack(len(payload)) + payload


@dataclass(slots=True, frozen=True)
class ChannelAddress:
    """Where an ingress listens. A replica on `node_id` uses `path`; others use TCP."""

    ingress_id: str
    node_id: str
    path: str
    secret: bytes
    host: str | None = None
    port: int | None = None


class ChannelClosedError(ConnectionError):
    """The token channel to the ingress broke; the requests on it cannot be delivered."""


# -- ingress side --------------------------------------------------------------------------------


class TokenInbox(OutputSlot):
    """One request's deltas as they arrive (merged while its reader lags), or an error."""

    __slots__ = ("_timer", "closed")

    def __init__(self) -> None:
        super().__init__()
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def fail_later(self, delay_s: float, error: BaseException) -> None:
        """Fail unless the request finishes within `delay_s` (its last frame is in flight)."""
        self._timer = asyncio.get_running_loop().call_later(delay_s, self.fail, error)

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()


class _InboundProtocol(asyncio.Protocol):
    """One replica's connection into the ingress: parse frames, deliver each delta."""

    def __init__(self, server: ChannelServer, transport: str) -> None:
        self._server = server
        self._kind = transport  # "unix" | "tcp"
        self._buffer = bytearray()
        self._transport: asyncio.BaseTransport | None = None
        self._authenticated = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def _drop(self, why: str) -> None:
        logger.warning("token channel: %s; closing the connection", why)
        self._buffer.clear()
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        if not self._authenticated:
            secret = self._server.secret
            if len(buffer) < len(secret):
                return
            if not hmac.compare_digest(bytes(buffer[: len(secret)]), secret):
                self._drop("a peer without the channel's secret")
                return
            self._authenticated = True
            self._server.accepted[self._kind] += 1
            start = len(secret)
        end = len(buffer)
        while end - start >= 4:
            (size,) = _HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME_BYTES:
                self._drop(f"a frame of {size} bytes")
                return
            if end - start - 4 < size:
                break
            try:
                items = json.loads(buffer[start + 4 : start + 4 + size])
            except ValueError:
                self._drop("a frame that is not JSON")
                return
            start += 4 + size
            self._server.deliver(items)
        if start:
            del buffer[:start]


class ChannelServer:
    """The ingress end: listens (Unix socket, plus TCP when `tcp_host` is set) and routes
    each arriving delta to the inbox of its request. Deltas of requests without an inbox
    (the client already left) are dropped. `accepted` counts the replica connections that
    proved the secret, by transport."""

    def __init__(self) -> None:
        self._inboxes: dict[str, TokenInbox] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._path: str | None = None
        self.secret = secrets.token_bytes(16)
        self.address: ChannelAddress | None = None
        self.accepted = dict.fromkeys(TRANSPORTS, 0)

    async def start(self, *, ingress_id: str, node_id: str, tcp_host: str | None) -> None:
        loop = asyncio.get_running_loop()
        # Unix socket paths are limited to ~107 bytes: keep it short, in the system temp dir.
        self._path = os.path.join(tempfile.gettempdir(), f"fl-{uuid.uuid4().hex[:16]}.sock")
        unix = await loop.create_unix_server(lambda: _InboundProtocol(self, "unix"), self._path)
        os.chmod(self._path, 0o600)
        self._servers.append(unix)
        host, port = None, None
        if tcp_host:
            tcp = await loop.create_server(lambda: _InboundProtocol(self, "tcp"), tcp_host, 0)
            self._servers.append(tcp)
            host, port = tcp.sockets[0].getsockname()[:2]
        self.address = ChannelAddress(ingress_id, node_id, self._path, self.secret, host, port)

    def snapshot(self) -> Snapshot:
        """`accepted` as the `token_channel_connections` counter (app/metric_snapshot.py)."""
        return {
            PREFIX + "token_channel_connections": {
                "type": "counter",
                "help": "Replica connections accepted by a token channel, by transport "
                "(unix: the replica is on the caller's node; tcp: on another node).",
                "labels": ["transport"],
                "series": [{"labels": [k], "value": float(n)} for k, n in self.accepted.items()],
            }
        }

    def open(self, request_id: str) -> TokenInbox:
        if request_id in self._inboxes:
            raise InvalidRequest("request_id", f"request id {request_id!r} is already running")
        inbox = self._inboxes[request_id] = TokenInbox()
        return inbox

    def close(self, request_id: str) -> None:
        inbox = self._inboxes.pop(request_id, None)
        if inbox is not None:
            inbox.close()

    def deliver(self, items: list[tuple[Any, ...]]) -> None:
        inboxes = self._inboxes
        now = time.monotonic()
        for item in items:
            inbox = inboxes.get(item[0])
            if inbox is not None:
                inbox.put(decode_delta(item), now)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)


# -- replica side --------------------------------------------------------------------------------


class ChannelSlot(OutputSlot):
    """A request's output on the replica: the engine `put`s deltas (merged while the socket
    is backed up); its connection takes them out once per step. `done` resolves when the
    last delta has been written, or fails with the engine's or the channel's error."""

    __slots__ = ("_mark", "done", "request_id")

    def __init__(self, request_id: str, mark: Callable[[ChannelSlot], None]) -> None:
        super().__init__()
        self.request_id = request_id
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._mark = mark

    def put(self, delta: TokenDelta, now: float) -> None:
        super().put(delta, now)
        if self.pending is not None:  # (a whole-output slot holds its deltas back)
            self._mark(self)

    def fail(self, error: BaseException) -> None:
        super().fail(error)
        if not self.done.done():
            self.done.set_exception(error)


class _Connection(asyncio.Protocol):
    """The replica's connection to one ingress. After each engine step (one loop callback
    after the engine's dispatch) it writes the pending deltas of its requests as one frame;
    while the transport is paused (the ingress is not reading) they keep merging."""

    def __init__(self, on_lost: Callable[[_Connection], None]) -> None:
        self._on_lost = on_lost
        self.kind = ""  # its transport, "unix" | "tcp", once connected
        self._transport: asyncio.WriteTransport | None = None
        self._dirty: dict[str, ChannelSlot] = {}
        self._slots: dict[str, ChannelSlot] = {}
        self._paused = False
        self._scheduled = False
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # uvloop's aren't subclasses

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._schedule()

    def data_received(self, data: bytes) -> None:  # the ingress never writes
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = ChannelClosedError(f"token channel to the ingress closed: {exc!r}")
        for slot in list(self._slots.values()):
            slot.fail(error)
        self._slots.clear()
        self._dirty.clear()
        self._on_lost(self)

    # slots
    def open(self, request_id: str) -> ChannelSlot:
        if self.closed:
            raise ChannelClosedError("token channel to the ingress is closed")
        slot = self._slots[request_id] = ChannelSlot(request_id, self._mark)
        return slot

    def close_slot(self, request_id: str) -> None:
        self._slots.pop(request_id, None)
        self._dirty.pop(request_id, None)

    def _mark(self, slot: ChannelSlot) -> None:
        self._dirty[slot.request_id] = slot
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and not self._paused and self._dirty:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._paused or self.closed or self._transport is None:
            return
        dirty, self._dirty = self._dirty, {}
        items = []
        finished = []
        for slot in dirty.values():
            delta, slot.pending = slot.pending, None
            if delta is None or slot.error is not None:
                continue
            items.append(encode_delta(delta))
            if delta.finish_reason is not None:
                finished.append(slot)
        if items:
            self._transport.write(frame(items))
        for slot in finished:
            if not slot.done.done():
                slot.done.set_result(None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class ChannelPool:
    """The replica's connections, one per ingress, opened on first use and kept."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._connections: dict[str, _Connection] = {}
        self._connecting: dict[str, asyncio.Future[_Connection]] = {}

    async def connection(self, address: ChannelAddress) -> _Connection:
        key = address.ingress_id
        conn = self._connections.get(key)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(key)
        if pending is None:
            pending = self._connecting[key] = asyncio.ensure_future(self._connect(address))
            pending.add_done_callback(lambda _: self._connecting.pop(key, None))
        return await asyncio.shield(pending)

    async def _connect(self, address: ChannelAddress) -> _Connection:
        loop = asyncio.get_running_loop()

        def factory() -> _Connection:
            return _Connection(on_lost=self._lost)

        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if address.node_id == self.node_id or address.host is None:
                transport, conn = await loop.create_unix_connection(factory, address.path)
                conn.kind, where = "unix", address.path
            else:
                transport, conn = await loop.create_connection(factory, address.host, address.port)
                conn.kind, where = "tcp", f"{address.host}:{address.port}"
        transport.write(address.secret)  # first bytes on the wire: who we are
        logger.info(
            "token channel to ingress %s over %s (%s)", address.ingress_id, conn.kind, where
        )
        self._connections[address.ingress_id] = conn
        return conn

    def _lost(self, conn: _Connection) -> None:
        for key, known in list(self._connections.items()):
            if known is conn:
                del self._connections[key]

    def close(self) -> None:
        for conn in list(self._connections.values()):
            conn.close()
        self._connections.clear()
