"""The direct channel between target replicas and a `DraftReplica`: one request per target
step, never a Serve handle call per step.

A target's `RemoteDraftProposer` (the engine's `Proposer`, called on the engine thread) keeps
one TCP connection to the DraftReplica and, each step, sends one `ProposeCall` with every
sequence it wants drafts for: the tokens the draft has not seen yet (`start` = how many it
has), how many drafts, and the sampling filters. The DraftReplica answers with the drafts
(and, for sampled requests, the distributions they were drawn from) or asks for a full resend
of a sequence it does not know (`resync`: a new DraftReplica after a restart). A request that
ends is released at once with a `Release` frame (no answer), so its draft KV is freed with
it. Serve handles are only used to learn the DraftReplica's address, off the engine thread,
when the target has none that works.

Failure never costs a request: a call that fails or takes longer than `timeout_s` returns no
drafts, drops the connection (the DraftReplica frees that connection's KV), and the proposer
stays off for a back-off that doubles with each consecutive failure (1 s to 30 s); a draft
that answers again brings speculation back.

Frames: a 4-byte big-endian length, then a pickle (cluster-internal: the same trust as Ray's
own object transfer). `DraftService` is the DraftReplica's side without sockets or Ray.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.request import SamplingParams
from engine.sequence import Sequence
from engine.spec.draft_model import DraftModel, DraftQuery
from engine.spec.proposer import Draft

logger = logging.getLogger("firstlight.draft")

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 256 * 1024 * 1024


# -- messages ------------------------------------------------------------------------------------


@dataclass(slots=True)
class DraftItem:
    request_id: str
    start: int  # tokens of the sequence the draft already has (from earlier calls)
    tokens: list[int]  # the sequence's tokens from `start` on
    num_tokens: int  # drafts wanted
    sampling: tuple[float, int, float, float]  # temperature, top_k, top_p, min_p


@dataclass(slots=True)
class ProposeCall:
    seq: int
    items: list[DraftItem]


@dataclass(slots=True)
class Release:
    """Requests that ended: free their draft KV (no reply)."""

    request_ids: list[str]


@dataclass(slots=True)
class ProposeReply:
    seq: int
    drafts: dict[str, tuple[list[int], bytes | None]]  # float32 [k, vocab] probs, or None
    resync: list[str] = field(default_factory=list)  # send these sequences whole next time


def send_frame(sock: socket.socket, message: object) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> object:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {size} bytes")
    return pickle.loads(_recv_exact(sock, size))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the draft closed the connection")
        buf += chunk
    return bytes(buf)


# -- the DraftReplica's side -------------------------------------------------------------------


class DraftService:
    """Serves `ProposeCall`s of several sessions (target connections) from one `DraftModel`.

    Not thread-safe: one caller at a time (the DraftReplica runs it on one worker thread)."""

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self._sessions: dict[int, dict[str, list[int]]] = {}  # true tokens per request
        self._next_session = 0
        self.num_calls = 0

    def open_session(self) -> int:
        self._next_session += 1
        self._sessions[self._next_session] = {}
        return self._next_session

    def close_session(self, session: int) -> None:
        for request_id in self._sessions.pop(session, {}):
            self.draft.release(_key(session, request_id))

    def release(self, session: int, request_ids: list[str]) -> None:
        known = self._sessions.get(session, {})
        for request_id in request_ids:
            if known.pop(request_id, None) is not None:
                self.draft.release(_key(session, request_id))

    def handle(self, calls: list[tuple[int, ProposeCall]]) -> list[ProposeReply]:
        """One reply per call; all calls' sequences drafted together in one batch."""
        queries: list[DraftQuery] = []
        replies: list[ProposeReply] = []
        for session, call in calls:
            known = self._sessions.setdefault(session, {})
            reply = ProposeReply(call.seq, {})
            for item in call.items:
                tokens = known.get(request_id := item.request_id)
                if tokens is None:
                    if item.start != 0:
                        reply.resync.append(request_id)
                        continue
                    tokens = known[request_id] = []
                if item.start > len(tokens):
                    reply.resync.append(request_id)
                    continue
                del tokens[item.start :]
                tokens.extend(item.tokens)
                temperature, top_k, top_p, min_p = item.sampling
                sampling = SamplingParams(
                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
                )
                queries.append(
                    DraftQuery(_key(session, request_id), tokens, item.num_tokens, sampling)
                )
            replies.append(reply)
        self.num_calls += len(calls)
        drafts = self.draft.propose(queries) if queries else {}
        by_session = {session: reply for (session, _), reply in zip(calls, replies, strict=True)}
        for key, draft in drafts.items():
            session, request_id = _split(key)
            probs = None if draft.probs is None else draft.probs.float().numpy().tobytes()
            by_session[session].drafts[request_id] = (draft.token_ids, probs)
        return replies


def _key(session: int, request_id: str) -> str:
    return f"{session}:{request_id}"


def _split(key: str) -> tuple[int, str]:
    session, request_id = key.split(":", 1)
    return int(session), request_id


# -- the target's side ---------------------------------------------------------------------------


class RemoteDraftProposer:
    """A `Proposer` whose drafts come from a DraftReplica (module doc). `propose` and `forget`
    run on the engine thread; `set_address` may be called from any thread."""

    def __init__(
        self,
        *,
        timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._address: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        self._sent: dict[str, int] = {}  # tokens of each request the draft has
        self._seq = 0
        self._failures = 0
        self._off_until = 0.0
        self.num_failures = 0

    # -- state the replica reads and sets ----------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the last call got an answer (or none was tried yet with an address)."""
        return self._sock is not None

    def needs_address(self) -> bool:
        return self._sock is None

    def set_address(self, address: tuple[str, int] | None) -> None:
        with self._lock:
            if address != self._address:
                self._address = address
                self._off_until = 0.0  # a new DraftReplica: try it at once

    # -- the Proposer protocol ---------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        sock = self._connection()
        if sock is None:
            return {}
        self._seq += 1
        items = []
        for seq in seqs:
            start = self._sent.get(seq.request_id, 0)
            sp = seq.sampling
            items.append(
                DraftItem(
                    seq.request_id,
                    start,
                    seq.token_ids[start:],
                    num_tokens[seq.request_id],
                    (sp.temperature, sp.top_k, sp.top_p, sp.min_p),
                )
            )
        call = ProposeCall(self._seq, items)
        try:
            send_frame(sock, call)
            reply = recv_frame(sock)
            if not isinstance(reply, ProposeReply) or reply.seq != call.seq:
                raise ConnectionError(f"unexpected reply {type(reply).__name__}")
        except (OSError, ConnectionError, EOFError, pickle.UnpicklingError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            return {}
        self._failures = 0
        for seq in seqs:
            self._sent[seq.request_id] = seq.num_tokens
        for request_id in reply.resync:
            self._sent[request_id] = 0
        out = {}
        for request_id, (token_ids, probs) in reply.drafts.items():
            dist = None
            if probs is not None:
                flat = torch.frombuffer(bytearray(probs), dtype=torch.float32)
                dist = flat.view(len(token_ids), -1)
            out[request_id] = Draft(token_ids, dist)
        return out

    def forget(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is None or self._sock is None:
            return
        try:
            send_frame(self._sock, Release([request_id]))
        except OSError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._drop()

    # -- the connection ------------------------------------------------------------------------

    def _connection(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        with self._lock:
            address = self._address
            if address is None or time.monotonic() < self._off_until:
                return None
        try:
            sock = socket.create_connection(address, timeout=self.connect_timeout_s)
        except OSError as exc:
            self._fail(f"connect to {address}: {exc}")
            return None
        sock.settimeout(self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._sent.clear()  # a new session: the draft knows nothing yet
        logger.info("speculating with the draft replica at %s:%d", *address)
        return sock

    def _fail(self, why: str) -> None:
        self._drop()
        self.num_failures += 1
        backoff = min(self.max_backoff_s, self.min_backoff_s * 2**self._failures)
        self._failures += 1
        self._off_until = time.monotonic() + backoff
        logger.warning(
            "draft replica unavailable (%s); decoding without drafts for %.0f s", why, backoff
        )

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._sent.clear()
