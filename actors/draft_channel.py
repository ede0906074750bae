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


@dataclass(slots=True)
class _Lookahead:
    """Drafts made ahead for the next call, valid if the target accepts every draft of this
    one and its own next token is the one the draft expects."""

    expected: list[int]  # the true tokens the next call must bring
    draft: Draft


class DraftService:
    """Serves `ProposeCall`s of several sessions (target connections) from one `DraftModel`.

    Drafting ahead (`look_ahead`, run while the targets verify, when no call waits): for each
    sequence just answered, the draft assumes all of its drafts are accepted and the target's
    own next token is the draft's guess, and drafts the step after. When the next call brings
    exactly those tokens (a run the target accepted whole), its drafts are ready: the draft's
    work overlapped the target's verification. Otherwise it drafts as usual (its KV rolls
    back to what the true tokens confirm).

    Not thread-safe: one caller at a time (the DraftReplica runs it on one worker thread)."""

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self._sessions: dict[int, dict[str, list[int]]] = {}  # true tokens per request
        self._next_session = 0
        self._answered: list[tuple[DraftQuery, Draft]] = []  # the last batch's, for look_ahead
        self._ahead: dict[str, _Lookahead] = {}
        self.num_calls = 0
        self.num_lookahead_hits = 0

    def open_session(self) -> int:
        self._next_session += 1
        self._sessions[self._next_session] = {}
        return self._next_session

    def close_session(self, session: int) -> None:
        self.release(session, list(self._sessions.get(session, {})))
        self._sessions.pop(session, None)

    def release(self, session: int, request_ids: list[str]) -> None:
        known = self._sessions.get(session, {})
        for request_id in request_ids:
            key = _key(session, request_id)
            self._ahead.pop(key, None)
            if known.pop(request_id, None) is not None:
                self.draft.release(key)

    def handle(self, calls: list[tuple[int, ProposeCall]]) -> list[ProposeReply]:
        """One reply per call; all calls' sequences drafted together in one batch."""
        queries: list[DraftQuery] = []  # to draft now
        served: list[DraftQuery] = []  # every sequence of the batch
        ready: dict[str, Draft] = {}  # drafted ahead
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
                key = _key(session, request_id)
                temperature, top_k, top_p, min_p = item.sampling
                sampling = SamplingParams(
                    temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
                )
                query = DraftQuery(key, tokens, item.num_tokens, sampling)
                served.append(query)
                ahead = self._ahead.pop(key, None)
                if ahead is not None and _matches(ahead, query):
                    ready[key] = _first(ahead.draft, item.num_tokens)
                    self.num_lookahead_hits += 1
                else:
                    queries.append(query)
            replies.append(reply)
        self.num_calls += len(calls)
        drafts = self.draft.propose(queries) if queries else {}
        drafts.update(ready)
        self._answered = [(q, drafts[q.request_id]) for q in served if q.request_id in drafts]
        by_session = {session: reply for (session, _), reply in zip(calls, replies, strict=True)}
        for key, draft in drafts.items():
            session, request_id = _split(key)
            probs = None if draft.probs is None else draft.probs.float().numpy().tobytes()
            by_session[session].drafts[request_id] = (draft.token_ids, probs)
        return replies

    def look_ahead(self) -> int:
        """Draft the step after the last call's, for each sequence it answered (class doc);
        returns how many sequences were drafted ahead."""
        answered, self._answered = self._answered, []
        queries = [
            DraftQuery(q.request_id, q.token_ids + d.token_ids, len(d.token_ids) + 1, q.sampling)
            for q, d in answered
            if self._is_known(q.request_id)  # not released since
        ]
        drafts = self.draft.propose(queries) if queries else {}
        for q in queries:
            d = drafts.get(q.request_id)
            if d is None or len(d.token_ids) < 2:
                continue
            guess = d.token_ids[0]  # what the draft expects the target's own token to be
            rest = Draft(d.token_ids[1:], None if d.probs is None else d.probs[1:])
            self._ahead[q.request_id] = _Lookahead([*q.token_ids, guess], rest)
        return len(self._ahead)

    def _is_known(self, key: str) -> bool:
        session, request_id = _split(key)
        return request_id in self._sessions.get(session, {})


def _matches(ahead: _Lookahead, query: DraftQuery) -> bool:
    """The call brings the tokens the lookahead assumed (only their tail can differ: true
    tokens only grow, and the lookahead began from the last call's true tokens)."""
    expected, tokens = ahead.expected, query.token_ids
    if len(tokens) != len(expected) or query.num_tokens > len(ahead.draft.token_ids):
        return False
    tail = len(ahead.draft.token_ids) + 2
    return tokens[-tail:] == expected[-tail:]


def _first(draft: Draft, k: int) -> Draft:
    return Draft(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k])


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
