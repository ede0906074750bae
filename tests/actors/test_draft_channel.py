"""The draft channel without Ray: an engine whose drafts come over TCP from a `DraftService`
(the DraftReplica's logic) decodes exactly as plain decoding, frees the draft KV of requests
that end, and goes on without drafts when the draft dies or stalls, until one answers again.
(tests/actors/test_draft_replica_serve.py runs the real DraftReplica under Serve.)"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.draft_channel import (
    DraftService,
    ProposeCall,
    Release,
    RemoteDraftProposer,
    recv_frame,
    send_frame,
)
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.spec.draft_model import DraftModel
from tests.engine.engine_fixture import (
    greedy,
    make_request,
    prompt_ids,
    tiny_config,
    tiny_draft_dir,
    tiny_model_dir,
)

PROMPTS = {"a": prompt_ids(1, 30), "b": prompt_ids(2, 17), "c": prompt_ids(3, 9)}


class DraftServer:
    """`DraftService` behind a TCP listener on 127.0.0.1, one thread per connection."""

    def __init__(self, delay_s: float = 0.0, model: Path | None = None) -> None:
        draft = DraftModel(model or tiny_model_dir(), kv_cache_bytes=1 << 20)
        self.service = DraftService(draft)
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.conns: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with self.lock:
            session = self.service.open_session()
        try:
            while True:
                msg = recv_frame(conn)
                with self.lock:
                    if isinstance(msg, Release):
                        self.service.release(session, msg.request_ids)
                        continue
                    assert isinstance(msg, ProposeCall)
                    time.sleep(self.delay_s)
                    (reply,) = self.service.handle([(session, msg)])
                send_frame(conn, reply)
                with self.lock:
                    self.service.look_ahead()  # as the DraftReplica does between calls
        except (ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                self.service.close_session(session)
            conn.close()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already closed by its thread
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        for thread in self.threads:
            thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[DraftServer]:
    s = DraftServer()
    yield s
    s.kill()


def engine_with(proposer: RemoteDraftProposer) -> LLMEngine:
    spec = SpeculativeConfig(method="draft_model", policy="fixed", max_num_tokens=4)
    return LLMEngine(tiny_config(speculative=spec), proposer=proposer)


def run(engine: LLMEngine, n: int = 24, each_step=None) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(make_request(rid, prompt, greedy(n)))
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None
            out[delta.request_id].extend(delta.token_ids)
        steps += 1
        if each_step is not None:
            each_step(steps)
    return out


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    return run(LLMEngine(tiny_config()))


def test_remote_drafts_decode_exactly_and_free_the_draft_kv(server, plain) -> None:
    proposer = RemoteDraftProposer()
    proposer.set_address(server.address)
    engine = engine_with(proposer)
    assert run(engine) == plain
    c = engine.counters
    assert c.draft_tokens > 0 and c.accepted_tokens == c.draft_tokens  # the target as draft
    # The target as its own draft accepts every run and guesses every bonus token: most
    # calls find their drafts made ahead.
    assert server.service.num_lookahead_hits > server.service.num_calls / 2
    assert proposer.available and engine.spec_stats().proposer_up == 1
    deadline = time.monotonic() + 5
    while server.service.draft.num_followed and time.monotonic() < deadline:
        time.sleep(0.01)  # Release frames are one-way: let the server read them
    draft = server.service.draft
    assert draft.num_followed == 0 and draft.kv.num_free_blocks == draft.kv.num_blocks


def test_drafts_that_miss_and_drafts_made_ahead_for_a_wrong_guess_keep_it_exact(plain) -> None:
    server = DraftServer(model=tiny_draft_dir())  # a draft that often disagrees
    proposer = RemoteDraftProposer()
    proposer.set_address(server.address)
    engine = engine_with(proposer)
    assert run(engine) == plain
    assert engine.counters.accepted_tokens < engine.counters.draft_tokens
    server.kill()


def test_a_dead_draft_costs_speculation_only_and_a_new_one_brings_it_back(plain) -> None:
    first, second = DraftServer(), DraftServer()
    proposer = RemoteDraftProposer(min_backoff_s=0.01)
    proposer.set_address(first.address)
    engine = engine_with(proposer)
    seen: dict[str, int] = {}

    def each_step(step: int) -> None:
        if step == 3:
            first.kill()  # mid-stream
            seen["at_kill"] = engine.counters.draft_tokens
        if step == 8:
            assert not proposer.available
            seen["while_dead"] = engine.counters.draft_tokens
            proposer.set_address(second.address)  # what the replica's finder does

    assert run(engine, n=40, each_step=each_step) == {
        rid: toks for rid, toks in run(LLMEngine(tiny_config()), n=40).items()
    }
    assert proposer.num_failures >= 1
    assert seen["while_dead"] - seen["at_kill"] <= 3 * 4  # at most the step that failed
    assert engine.counters.draft_tokens > seen["while_dead"]  # speculation came back
    assert second.service.num_calls > 0
    second.kill()


def test_a_stalled_draft_times_out_and_backs_off() -> None:
    slow = DraftServer(delay_s=0.5)
    proposer = RemoteDraftProposer(timeout_s=0.05, min_backoff_s=30)
    proposer.set_address(slow.address)
    engine = engine_with(proposer)
    started = time.monotonic()
    out = run(engine, n=16)
    assert all(len(t) == 16 for t in out.values())
    assert proposer.num_failures == 1  # one timeout, then decoding without drafts
    assert engine.counters.draft_tokens == 0
    assert time.monotonic() - started < 5
    slow.kill()
