"""The ModelReplica class around the real engine, without a Ray cluster: warm start, the
token stream, refusals as typed items, cancellation (what Serve does on client disconnect),
health, and the stats push."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.cluster import ReplicaReport
from actors.messages import ErrorKind, ReplicaError, ReplicaInfo
from actors.model_replica import ModelReplica
from engine.request import Request, SamplingParams, clock_base
from engine.sched.admission import Admission
from engine.stats import EngineStats
from tests.actors.helpers import require_demo_model, small_config
from tests.engine.step_gate import FakeClock

pytestmark = pytest.mark.slow


class FakeControlPlane:
    """Records what the replica pushes (`handle.report_replica.remote(report)`)."""

    def __init__(self) -> None:
        self.reports: list[ReplicaReport] = []
        self.removed: list[str] = []

    @property
    def report_replica(self) -> Any:
        return self._method(self.reports.append)

    @property
    def remove_replica(self) -> Any:
        return self._method(self.removed.append)

    @staticmethod
    def _method(record: Any) -> Any:
        class Method:
            @staticmethod
            async def remote(arg: Any) -> None:
                record(arg)

        return Method


async def make_replica(control_plane: FakeControlPlane | None = None, **sections: Any) -> Any:
    require_demo_model()
    cls = ModelReplica.func_or_class  # the plain class under @serve.deployment
    replica = cls.__new__(cls)
    config = small_config(replica={"stats_interval_s": 0.05}, **sections)
    await replica.__init__(config, control_plane)
    return replica


def request(rid: str, prompt: list[int], **sampling: Any) -> Request:
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling}
    return Request(rid, prompt, SamplingParams(**params))


async def prompt_ids(replica: Any) -> list[int]:
    return list(replica.engine.tokenizer.encode("Can I pause my annual subscription?"))


async def test_a_started_replica_is_warm_and_streams_every_token():
    replica = await make_replica()
    try:
        stats = await replica.stats()
        assert stats.engine.num_steps >= 1  # the warm-up request ran before __init__ returned
        assert stats.rss_bytes > 0 and stats.replica_id == replica.replica_id
        info = await replica.info()
        assert isinstance(info, ReplicaInfo) and info.model == "demo"
        assert info.max_model_len == replica.engine.max_model_len
        # sent from a host whose monotonic clock is a day ahead, 0.1 s ago
        sent = request("a", await prompt_ids(replica))
        sent.arrival_time = time.monotonic() + 86400 - 0.1
        sent.sender_clock = clock_base() + 86400
        deltas = [d async for d in replica.generate(sent)]
        assert sum(len(d.token_ids) for d in deltas) == 8
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        timings = deltas[-1].timings
        assert timings is not None and 0.09 < timings.queue_s < 5  # on the replica's clock
        await replica.check_health()
    finally:
        await replica.__del__()


async def test_refusals_come_back_as_one_typed_item():
    replica = await make_replica()
    try:
        too_long = request("long", [1] * (replica.engine.max_model_len + 1))
        items = [i async for i in replica.generate(too_long)]
        assert len(items) == 1 and isinstance(items[0], ReplicaError)
        assert (items[0].kind, items[0].param) == (ErrorKind.INVALID, "prompt")

        # A drain rate of 0.5 per second (finishes at t = 0, 2, 4 on the admission's clock).
        clock = FakeClock()
        replica.engine.admission = Admission(4, clock=clock)
        for _ in range(3):
            replica.engine.admission.record_finished()
            clock.advance(2.0)
        clock.advance(-2.0)

        # 4 running + 4 waiting fill this replica; the rest are refused with 429 semantics.
        prompt = await prompt_ids(replica)
        streams = [replica.generate(request(f"f{i}", prompt, max_tokens=64)) for i in range(12)]
        firsts = await asyncio.gather(*(anext(s) for s in streams))
        refused = [f for f in firsts if isinstance(f, ReplicaError)]
        assert refused and all(f.kind is ErrorKind.QUEUE_FULL for f in refused)
        assert len(refused) <= 12 - 4
        # The Retry-After crossing the hop is the engine's decision: 4 ahead at 0.5 per second.
        assert {f.retry_after_s for f in refused} == {8.0}
        assert refused[0].exception().retry_after_s == 8.0  # what the ingress re-raises
        for s in streams:
            await s.aclose()
    finally:
        await replica.__del__()


async def test_cancellation_aborts_the_request_and_frees_its_blocks():
    replica = await make_replica()
    try:
        baseline = await replica.stats()
        stream = replica.generate(request("c", await prompt_ids(replica), max_tokens=200))
        await anext(stream)
        await anext(stream)
        assert (
            await replica.stats()
        ).engine.kv.num_free_blocks < baseline.engine.kv.num_free_blocks
        # What Serve does when the client disconnects: CancelledError at the suspended yield.
        with pytest.raises(asyncio.CancelledError):
            await stream.athrow(asyncio.CancelledError())
        for _ in range(100):  # the abort lands within one engine step
            stats = await replica.stats()
            if stats.engine.kv.num_free_blocks == baseline.engine.kv.num_free_blocks:
                break
            await asyncio.sleep(0.01)
        assert stats.engine.kv.num_free_blocks == baseline.engine.kv.num_free_blocks
        assert stats.engine.num_cancelled == baseline.engine.num_cancelled + 1
        assert stats.engine.running.total == 0
    finally:
        await replica.__del__()


@contextlib.asynccontextmanager
async def replica_and_channel() -> AsyncIterator[tuple[Any, Any]]:
    """A replica and a caller's token channel on the same node (as BatchJobs has)."""
    from actors.token_channel import ChannelServer

    replica = await make_replica()
    server = ChannelServer()
    await server.start(ingress_id="batch", node_id=replica.channels.node_id, tcp_host=None)
    try:
        yield replica, server
    finally:
        await server.stop()
        await replica.__del__()


def opened(server: Any, requests: list[Request]) -> dict[str, Any]:
    """Each request's inbox on `server`; each wants its output whole (as a batch line)."""
    for r in requests:
        r.whole_output = True
    return {r.request_id: server.open(r.request_id) for r in requests}


async def test_a_group_call_streams_each_request_and_cancelling_it_aborts_them_all():
    """`stream_group`, as a batch's lines reach the replica: each request's whole output over
    the token channel, each outcome in order (a refusal is that request's alone), and
    Serve's cancel of the call aborts every request still running."""
    async with replica_and_channel() as (replica, server):
        assert server.address is not None
        prompt = await prompt_ids(replica)
        group = [request(f"g{i}", prompt, max_tokens=4 + i) for i in range(3)]
        group.insert(1, request("long", [1] * (replica.engine.max_model_len + 1)))
        inboxes = opened(server, group)
        outcomes = await replica.stream_group(group, server.address)
        assert outcomes[0] is None and outcomes[2] is None and outcomes[3] is None
        assert isinstance(outcomes[1], ReplicaError) and outcomes[1].param == "prompt"
        for i in range(3):
            (last,) = [await inboxes[f"g{i}"].get()]  # whole output: one delta
            assert last.finish_reason == "length" and len(last.token_ids) == 4 + i

        baseline = await replica.stats()
        long_ones = [request(f"h{i}", prompt, max_tokens=400) for i in range(2)]
        for r in long_ones:
            server.open(r.request_id)
        call = asyncio.ensure_future(replica.stream_group(long_ones, server.address))
        for _ in range(200):
            if (await replica.stats()).engine.running.total == 2:
                break
            await asyncio.sleep(0.01)
        assert (await replica.stats()).engine.running.total == 2
        call.cancel()  # what Serve does when the caller cancels the call
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):  # the aborts land within one engine step
            stats = await replica.stats()
            if stats.engine.running.total == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.engine.running.total == 0
        assert stats.engine.num_cancelled == baseline.engine.num_cancelled + 2
        assert stats.engine.kv.num_free_blocks == baseline.engine.kv.num_free_blocks


async def test_a_request_failing_after_it_started_fails_alone_in_its_group():
    """What fails one request once it runs (here the engine's stall cut, as
    `AsyncEngine._cut_stalled_readers` applies it) is that request's outcome; the others of
    its call run to their end."""
    from engine.async_engine import ReaderStalledError

    async with replica_and_channel() as (replica, server):
        assert server.address is not None
        prompt = await prompt_ids(replica)
        group = [request(rid, prompt, max_tokens=64) for rid in ("a", "cut", "b")]
        inboxes = opened(server, group)
        call = asyncio.ensure_future(replica.stream_group(group, server.address))
        engine = replica.engine
        for _ in range(200):
            if (await replica.stats()).engine.running.total == 3:
                break
            await asyncio.sleep(0.01)
        engine._submit(abort="cut")
        engine._slots["cut"].fail(ReaderStalledError("reader stalled for more than 30s"))
        outcomes = await call
        assert outcomes[0] is None and outcomes[2] is None
        assert isinstance(outcomes[1], ReplicaError) and outcomes[1].kind is ErrorKind.UNAVAILABLE
        for rid in ("a", "b"):
            last = await inboxes[rid].get()
            assert last.finish_reason == "length" and len(last.token_ids) == 64


async def test_stats_are_pushed_and_health_fails_once_the_engine_loop_is_gone():
    control_plane = FakeControlPlane()
    replica = await make_replica(control_plane)
    for _ in range(100):
        if len(control_plane.reports) >= 2:
            break
        await asyncio.sleep(0.02)
    report = control_plane.reports[-1]
    assert (report.replica_id, report.model, report.healthy) == (replica.replica_id, "demo", True)
    assert isinstance(report.stats, EngineStats) and report.stats.model == "demo"
    routing = await replica.record_routing_stats()
    assert routing == {
        "kv_cache_usage_perc": report.stats.kv.usage,
        "kv_num_free_blocks": report.stats.kv.num_free_blocks,
        "num_requests_running": 0,
        "num_requests_waiting": 0,
    }

    def broken_step(*args: object) -> list:
        raise RuntimeError("CUDA error: device-side assert")  # the engine thread dies

    replica.engine.engine.step = broken_step
    doomed = [i async for i in replica.generate(request("d", [1, 2, 3]))]
    assert [i.kind for i in doomed] == [ErrorKind.UNAVAILABLE]  # failed with its engine
    with pytest.raises(RuntimeError, match="not running"):
        await replica.check_health()
    items = [i async for i in replica.generate(request("x", [1, 2, 3]))]
    assert len(items) == 1 and items[0].kind is ErrorKind.UNAVAILABLE
    await replica.__del__()
    assert control_plane.removed == [replica.replica_id]
