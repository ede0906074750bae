"""ReplicaClient against a stand-in DeploymentHandle: what crosses the hop, and what comes out."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from actors.messages import ErrorKind, ReplicaError
from actors.replica_client import ReplicaClient
from actors.settings import IngressSettings
from actors.token_channel import ChannelPool
from engine.errors import InvalidRequest, QueueFull, Unavailable
from engine.request import FinishReason, Request, RequestClass, TokenDelta


class FakeResponse:
    """Stands in for a DeploymentResponseGenerator: yields `items`, then raises `error`
    (if any), or waits forever when `hang`."""

    def __init__(
        self,
        items: list[Any],
        error: BaseException | None = None,
        hang: bool = False,
        cancel_error: BaseException | None = None,
    ) -> None:
        self.items = list(items)
        self.error = error
        self.hang = hang
        self.cancel_error = cancel_error
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True
        if self.cancel_error is not None:  # Serve re-raises a failed assignment's error
            raise self.cancel_error


class FakeHandle:
    def __init__(self, response: FakeResponse) -> None:
        self.response = response
        self.options_seen: dict[str, Any] = {}
        self.sent: list[Request] = []

    def options(self, **kwargs: Any) -> FakeHandle:
        self.options_seen = kwargs
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    def remote(self, request: Request) -> FakeResponse:
        self.sent.append(request)
        return self.response


def delta(n: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta("r1", [n], f"t{n}", finish_reason=finish, num_output_tokens=n)


REQUEST = Request("r1", [1, 2, 3])


async def drain(client: ReplicaClient) -> list[TokenDelta]:
    return [d async for d in client.generate(REQUEST)]


async def test_deltas_pass_through_and_a_finished_call_is_not_cancelled():
    response = FakeResponse([delta(1), delta(2), delta(3, FinishReason.STOP)])
    handle = FakeHandle(response)
    client = ReplicaClient(handle, transport={"_by_reference": False})
    REQUEST.sender_clock = None
    assert [d.text for d in await drain(client)] == ["t1", "t2", "t3"]
    assert handle.options_seen == {"stream": True, "_by_reference": False}
    assert handle.sent == [REQUEST]
    assert REQUEST.sender_clock is not None  # the replica moves its times onto its own clock
    assert not response.cancelled


@pytest.mark.parametrize(
    ("error", "expected", "check"),
    [
        (
            ReplicaError(ErrorKind.QUEUE_FULL, "full", retry_after_s=7.0),
            QueueFull,
            lambda e: e.retry_after_s == 7.0,
        ),
        (
            ReplicaError(ErrorKind.INVALID, "too long", param="prompt"),
            InvalidRequest,
            lambda e: (e.param, e.message) == ("prompt", "too long"),
        ),
        (
            ReplicaError(ErrorKind.UNAVAILABLE, "loop died"),
            Unavailable,
            lambda e: "loop died" in str(e),
        ),
    ],
)
async def test_replica_refusals_become_the_engines_own_exceptions(error, expected, check):
    response = FakeResponse([error])
    with pytest.raises(expected) as info:
        await drain(ReplicaClient(FakeHandle(response)))
    assert check(info.value)
    assert not response.cancelled  # the replica's call already ended


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (
            BackPressureError(num_queued_requests=9, max_queued_requests=8, retry_after_s=2.0),
            QueueFull,
        ),
        (ActorDiedError(), Unavailable),
        (RayTaskError("generate", "traceback", ActorDiedError()), Unavailable),
        (RayTaskError("generate", "traceback", KeyError("boom")), RuntimeError),
    ],
)
async def test_serve_and_ray_failures_are_translated(raised, expected):
    response = FakeResponse([delta(1)], error=raised, cancel_error=raised)
    with pytest.raises(expected):
        await drain(ReplicaClient(FakeHandle(response)))
    assert response.cancelled


async def test_a_stream_that_ends_without_its_last_delta_is_an_error():
    with pytest.raises(RuntimeError, match="ended before its last delta"):
        await drain(ReplicaClient(FakeHandle(FakeResponse([delta(1)]))))


async def test_closing_early_cancels_the_replica_call():
    response = FakeResponse([delta(1), delta(2)], hang=True)
    stream = ReplicaClient(FakeHandle(response)).generate(REQUEST)
    assert (await anext(stream)).text == "t1"
    await stream.aclose()
    assert response.cancelled


async def test_abort_cancels_the_request_in_flight():
    response = FakeResponse([delta(1)], hang=True)
    client = ReplicaClient(FakeHandle(response))
    stream = client.generate(REQUEST)
    await anext(stream)
    await client.abort("other-id")
    assert not response.cancelled
    await client.abort("r1")
    assert response.cancelled
    await stream.aclose()


async def test_admission_refuses_before_anything_is_sent():
    def full(request: Request) -> None:
        raise QueueFull(retry_after_s=3.0)

    handle = FakeHandle(FakeResponse([delta(1, FinishReason.STOP)]))
    client = ReplicaClient(handle, admit=full, stats=lambda: {"num_replicas": 2})
    with pytest.raises(QueueFull):
        await drain(client)
    assert handle.sent == []
    assert client.stats() == {"num_replicas": 2}


async def test_admitted_requests_count_in_flight_from_the_check_until_they_start():
    """A burst's requests all pass the early check before the first one starts (each
    tokenizes in between): each holds a place from its check on, handed over when it starts,
    or given back after `reserve_s` if it never does."""
    seen: list[int] = []

    def capacity(request_class: RequestClass, count: int, in_flight: int) -> None:
        seen.append(in_flight)
        if in_flight + count > 3:
            raise QueueFull("full", retry_after_s=1.0)

    now = [100.0]
    response = FakeResponse([delta(1)], hang=True)
    client = ReplicaClient(
        FakeHandle(response), capacity=capacity, reserve_s=5.0, clock=lambda: now[0]
    )
    client.check_admission(RequestClass.INTERACTIVE, 2)  # n=2: two places
    client.check_admission(RequestClass.INTERACTIVE, 1)
    with pytest.raises(QueueFull):  # nothing has started, yet three places are taken
        client.check_admission(RequestClass.INTERACTIVE, 1)
    stream = client.generate(REQUEST)
    await anext(stream)  # started: in flight itself, its place handed over
    with pytest.raises(QueueFull):
        client.check_admission(RequestClass.INTERACTIVE, 1)
    assert seen == [0, 2, 3, 3]
    now[0] += 5.0  # the two that never started give their places back
    client.check_admission(RequestClass.INTERACTIVE, 1)
    assert seen[-1] == 1
    client.release_admission(1)  # that one failed before it started (a bad prompt, say)
    client.check_admission(RequestClass.INTERACTIVE, 2)
    assert seen[-1] == 1
    client.release_admission(5)  # never more than are held
    client.check_admission(RequestClass.INTERACTIVE, 1)
    assert seen[-1] == 1
    await stream.aclose()


# -- the token-channel path (a real ChannelServer and replica-side pool over a Unix socket) --


class ChannelCall:
    """Stands in for the unary `stream_to` call: plays the replica over a real channel
    connection (sends `deltas`, one per step), then returns `result` or raises `error`; or
    waits until cancelled when `hang`."""

    def __init__(self, pool, address, deltas, result=None, error=None, hang=False):
        self.pool, self.address = pool, address
        self.deltas, self.result, self.error, self.hang = deltas, result, error, hang
        self.cancelled = False
        self._task: asyncio.Task | None = None

    def __await__(self):
        self._task = asyncio.ensure_future(self._run())
        return self._task.__await__()

    async def _run(self):
        conn = await self.pool.connection(self.address)
        slot = conn.open("r1")
        try:
            for d in self.deltas:
                slot.put(d, now=0.0)
                await asyncio.sleep(0.001)
            if self.hang:
                await asyncio.Event().wait()
            if self.deltas and self.deltas[-1].finished:
                await slot.done
            if self.error is not None:
                raise self.error
            return self.result
        finally:
            conn.close_slot("r1")  # as ModelReplica.stream_to does

    def cancel(self) -> None:
        self.cancelled = True
        if self._task is not None:
            self._task.cancel()


class ChannelHandle:
    def __init__(self, make_call) -> None:
        self.make_call = make_call
        self.calls: list[ChannelCall] = []
        self.options_seen: dict[str, Any] = {}

    def options(self, **kwargs: Any) -> ChannelHandle:
        self.options_seen = kwargs
        return self

    @property
    def stream_to(self) -> ChannelHandle:
        return self

    def remote(self, request: Request, address) -> ChannelCall:
        assert request.sender_clock is not None  # the replica moves its times onto its clock
        call = self.make_call(address)
        self.calls.append(call)
        return call


@pytest.fixture
async def channel():
    from actors.token_channel import ChannelPool, ChannelServer

    server = ChannelServer()
    await server.start(ingress_id="ing", node_id="n", tcp_host=None)
    pool = ChannelPool("n")
    yield server, pool
    pool.close()
    await server.stop()


async def test_channel_deltas_arrive_and_a_finished_call_is_not_cancelled(channel):
    server, pool = channel
    deltas = [delta(1), delta(2), delta(3, FinishReason.STOP)]
    handle = ChannelHandle(lambda address: ChannelCall(pool, address, deltas))
    client = ReplicaClient(handle, channel=server)
    REQUEST.sender_clock = None
    got = await drain(client)
    assert "".join(d.text for d in got) == "t1t2t3"
    assert got[-1].finish_reason is FinishReason.STOP
    assert not handle.calls[0].cancelled
    assert server._inboxes == {}


async def test_channel_refusals_and_failures_become_the_engines_exceptions(channel):
    server, pool = channel
    refusal = ReplicaError(ErrorKind.QUEUE_FULL, "full", retry_after_s=4.0)
    client = ReplicaClient(
        ChannelHandle(lambda a: ChannelCall(pool, a, [], result=refusal)), channel=server
    )
    with pytest.raises(QueueFull) as info:
        await drain(client)
    assert info.value.retry_after_s == 4.0

    died = RayTaskError("stream_to", "traceback", ActorDiedError())
    client = ReplicaClient(
        ChannelHandle(lambda a: ChannelCall(pool, a, [delta(1)], error=died)), channel=server
    )
    stream = client.generate(REQUEST)
    assert (await anext(stream)).text == "t1"  # what arrived before the failure is delivered
    with pytest.raises(Unavailable):
        await anext(stream)


async def test_channel_call_done_without_its_last_delta_is_an_error(channel):
    server, pool = channel
    handle = ChannelHandle(lambda a: ChannelCall(pool, a, [delta(1)], result=None))
    client = ReplicaClient(handle, channel=server, final_delta_grace_s=0.05)
    with pytest.raises(RuntimeError, match="last delta never came"):
        await drain(client)


async def test_channel_closing_early_cancels_the_replica_call(channel):
    server, pool = channel
    handle = ChannelHandle(lambda a: ChannelCall(pool, a, [delta(1)], hang=True))
    client = ReplicaClient(handle, channel=server)
    stream = client.generate(REQUEST)
    assert (await anext(stream)).text == "t1"
    await stream.aclose()
    assert handle.calls[0].cancelled
    assert server._inboxes == {}


class FailingOnCancel(ChannelCall):
    """As Serve's response does: a cancelled call ends with an exception (Serve raises
    `RequestCancelledError`), not as a cancelled future."""

    async def _run(self):
        try:
            return await super()._run()
        except asyncio.CancelledError:
            raise RuntimeError("request cancelled") from None


async def test_a_call_failing_after_its_reader_left_is_not_an_unretrieved_error(channel):
    """A client cancel must not leave asyncio's "Task exception was never retrieved"
    traceback in the ingress log."""
    import gc

    server, pool = channel
    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        handle = ChannelHandle(lambda a: FailingOnCancel(pool, a, [delta(1)], hang=True))
        client = ReplicaClient(handle, channel=server)
        stream = client.generate(REQUEST)
        assert (await anext(stream)).text == "t1"
        await stream.aclose()
        for _ in range(5):
            await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert handle.calls[0].cancelled
    assert unretrieved == []


# -- ReplicaClient.connect: a client any deployment can build ----------------------------------


@pytest.mark.parametrize(("tcp_host", "over_tcp"), [("off", False), ("127.0.0.1", True)])
async def test_connect_starts_its_own_channel_and_close_stops_it(tcp_host, over_tcp):
    pool = ChannelPool("replica-node")  # another node than the client's: TCP when it listens
    deltas = [delta(1), delta(2, FinishReason.STOP)]
    handle = ChannelHandle(lambda address: ChannelCall(pool, address, deltas))
    settings = IngressSettings(channel_tcp_host=tcp_host)
    client = await ReplicaClient.connect(handle, settings, owner_id="batch-jobs-1")
    try:
        channel = client.channel
        assert channel is not None and channel.address is not None
        address = channel.address
        assert address.ingress_id == "batch-jobs-1"
        assert (address.host is not None) == over_tcp
        assert handle.options_seen == settings.handle_options()  # grpc transport by default
        assert "".join(d.text for d in await drain(client)) == "t1t2"
    finally:
        pool.close()
        await client.close()
    assert not os.path.exists(address.path)  # the listener is gone
    with pytest.raises(OSError):
        await ChannelPool(address.node_id).connection(address)
    await client.close()  # closing twice is harmless


async def test_connect_on_the_stream_path_has_no_channel():
    response = FakeResponse([delta(1), delta(2, FinishReason.STOP)])
    handle = FakeHandle(response)
    settings = IngressSettings(token_path="stream", transport="actor")
    client = await ReplicaClient.connect(handle, settings)
    assert client.channel is None
    assert [d.text for d in await drain(client)] == ["t1", "t2"]
    assert handle.options_seen == {"stream": True}  # actor transport: no handle options
    await client.close()


async def test_a_client_given_a_channel_does_not_stop_it(channel):
    server, pool = channel
    deltas = [delta(1, FinishReason.STOP)]
    client = ReplicaClient(ChannelHandle(lambda a: ChannelCall(pool, a, deltas)), channel=server)
    await client.close()
    assert [d.text for d in await drain(client)] == ["t1"]  # still listening


# -- bulk whole-output requests started together: one Serve call -------------------------------


class GroupCall(ChannelCall):
    """Stands in for `ModelReplica.stream_group`: plays the replica for each request over a
    real channel connection (its whole output as one final delta), then returns each one's
    outcome (`refuse`: request id → its `ReplicaError`, sent no delta); raises `error`; or,
    when `hang`, waits until cancelled before sending anything."""

    def __init__(self, pool, address, requests, refuse=None, error=None, hang=False, hold=()):
        super().__init__(pool, address, [], error=error, hang=hang)
        self.requests, self.refuse, self.hold = requests, refuse or {}, set(hold)

    async def _run(self):
        conn = await self.pool.connection(self.address)
        if self.hang:
            await asyncio.Event().wait()
        outcomes = []
        for request in self.requests:
            rid = request.request_id
            if rid in self.refuse:
                outcomes.append(self.refuse[rid])
                continue
            if rid in self.hold:  # still running: no delta yet, the call goes on
                outcomes.append(None)
                continue
            slot = conn.open(rid)
            final = TokenDelta(
                rid, [7], f"all of {rid}", finish_reason=FinishReason.LENGTH, num_output_tokens=1
            )
            slot.put(final, now=0.0)
            await slot.done
            conn.close_slot(rid)
            outcomes.append(None)
        if self.hold:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return outcomes


class GroupHandle(ChannelHandle):
    """`stream_to` as ChannelHandle; `stream_group` plays `make_group(address, requests)`."""

    def __init__(self, make_call, make_group) -> None:
        super().__init__(make_call)
        self.make_group = make_group
        self.groups: list[GroupCall] = []

    @property
    def stream_group(self) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(requests: list[Request], address) -> GroupCall:
                assert all(r.sender_clock is not None for r in requests)
                call = handle.make_group(address, requests)
                handle.groups.append(call)
                return call

        return Method


def bulk(rid: str, whole: bool = True, cls: RequestClass = RequestClass.BULK) -> Request:
    return Request(rid, [1, 2, 3], request_class=cls, whole_output=whole)


async def texts(client: ReplicaClient, request: Request) -> str:
    return "".join([d.text async for d in client.generate(request)])


async def test_bulk_whole_output_requests_started_together_share_one_call(channel):
    server, pool = channel
    handle = GroupHandle(
        lambda a: ChannelCall(pool, a, [delta(1, FinishReason.STOP)]),
        lambda a, requests: GroupCall(pool, a, requests),
    )
    client = ReplicaClient(handle, channel=server, group_max=16)
    chat = bulk("r1", cls=RequestClass.INTERACTIVE)  # (plays as "r1" over stream_to)
    lines = [bulk(f"b{i}") for i in range(3)]
    got = await asyncio.gather(*(texts(client, r) for r in [*lines, chat]))
    assert got == ["all of b0", "all of b1", "all of b2", "t1"]
    assert [[r.request_id for r in g.requests] for g in handle.groups] == [["b0", "b1", "b2"]]
    assert len(handle.calls) == 1  # the interactive request: a call of its own
    streamed = bulk("r1", whole=False)  # a streamed bulk request is never grouped either
    assert await texts(client, streamed) == "t1"
    assert len(handle.groups) == 1 and len(handle.calls) == 2
    assert not any(g.cancelled for g in handle.groups)
    assert server._inboxes == {} and client._inflight == {}


async def test_a_group_holds_at_most_group_max_and_each_member_has_its_own_outcome(channel):
    server, pool = channel
    refusal = ReplicaError(ErrorKind.QUEUE_FULL, "full", retry_after_s=3.0)
    handle = GroupHandle(None, lambda a, rs: GroupCall(pool, a, rs, refuse={"b1": refusal}))
    client = ReplicaClient(handle, channel=server, group_max=2)
    got = await asyncio.gather(
        *(texts(client, bulk(f"b{i}")) for i in range(3)), return_exceptions=True
    )
    assert got[0] == "all of b0" and got[2] == "all of b2"
    assert isinstance(got[1], QueueFull) and got[1].retry_after_s == 3.0
    assert [[r.request_id for r in g.requests] for g in handle.groups] == [["b0", "b1"], ["b2"]]

    died = RayTaskError("stream_group", "traceback", ActorDiedError())
    handle = GroupHandle(None, lambda a, rs: GroupCall(pool, a, [], error=died))
    client = ReplicaClient(handle, channel=server, group_max=16)
    got = await asyncio.gather(
        *(texts(client, bulk(f"c{i}")) for i in range(2)), return_exceptions=True
    )
    assert all(isinstance(g, Unavailable) for g in got)  # the call failed: every member
    assert server._inboxes == {}

    sent: list[list[Request]] = []

    def refused(address, requests):  # Serve's own queue is full: raised by .remote()
        sent.append(requests)
        raise BackPressureError(num_queued_requests=9, max_queued_requests=8)

    for group_max in (16, 2):  # sent at the end of the pass, and at once when it fills up
        client = ReplicaClient(GroupHandle(None, refused), channel=server, group_max=group_max)
        got = await asyncio.gather(
            *(texts(client, bulk(f"d{i}")) for i in range(2)), return_exceptions=True
        )
        assert all(isinstance(g, QueueFull) for g in got)
        await asyncio.sleep(0.01)
        assert len(sent) == 1  # refused once, never sent again
        sent.clear()
    assert server._inboxes == {} and client._inflight == {}


async def test_a_group_call_is_cancelled_once_every_member_has_left(channel):
    server, pool = channel
    handle = GroupHandle(None, lambda a, rs: GroupCall(pool, a, rs, hang=True))
    client = ReplicaClient(handle, channel=server, group_max=16)
    streams = [client.generate(bulk(f"b{i}")) for i in range(2)]
    reads = [asyncio.ensure_future(anext(s)) for s in streams]
    await asyncio.sleep(0.05)
    (group,) = handle.groups
    assert len(group.requests) == 2 and not any(r.done() for r in reads)
    reads[0].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reads[0]
    await streams[0].aclose()
    await asyncio.sleep(0.01)
    assert not group.cancelled  # the other member still waits for its output
    await client.abort("b1")  # `EngineClient.abort`: leave it unfinished
    assert group.cancelled
    reads[1].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reads[1]
    await streams[1].aclose()
    assert server._inboxes == {} and client._inflight == {}

    # one member got its whole output, the other's reader leaves: nothing is left to wait for
    handle = GroupHandle(None, lambda a, rs: GroupCall(pool, a, rs, hold={"c1"}))
    client = ReplicaClient(handle, channel=server, group_max=16)
    done = asyncio.ensure_future(texts(client, bulk("c0")))
    held = client.generate(bulk("c1"))
    read = asyncio.ensure_future(anext(held))
    assert await done == "all of c0"
    assert not handle.groups[0].cancelled  # c1 still runs
    read.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await read
    await held.aclose()
    assert handle.groups[0].cancelled
