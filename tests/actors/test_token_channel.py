"""The token channel over a real Unix socket: framing, per-step frames, backpressure, loss."""

from __future__ import annotations

import asyncio
import json

import pytest

from actors.token_channel import (
    ChannelClosedError,
    ChannelPool,
    ChannelServer,
    _InboundProtocol,
    decode_delta,
    encode_delta,
    frame,
)
from engine.errors import InvalidRequest
from engine.request import FinishReason, Timings, TokenDelta, TokenLogprob


def delta(rid: str, n: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(rid, [n], f"t{n}", finish_reason=finish, num_output_tokens=n)


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every test on both loops: Ray runs actors on uvloop, whose transports differ."""
    if request.param == "uvloop":
        import uvloop

        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


@pytest.fixture
async def server():
    server = ChannelServer()
    await server.start(ingress_id="ing-1", node_id="node-a", tcp_host=None)
    yield server
    await server.stop()


async def until(predicate, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


def test_deltas_survive_the_wire_format():
    full = TokenDelta(
        "r1",
        [5, 6],
        "héllo",
        finish_reason=FinishReason.STOP,
        logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.25)]), TokenLogprob(6, -0.1)],
        num_prompt_tokens=9,
        num_output_tokens=2,
        num_cached_tokens=4,
        timings=Timings(1.0, 1.5, 2.0, 3.0),
        error=None,
    )
    bare = TokenDelta("r2", [], "")
    for original in (full, bare):
        item = json.loads(json.dumps(encode_delta(original)))  # what crosses the wire
        assert decode_delta(item) == original
    assert decode_delta(encode_delta(full)).finish_reason is FinishReason.STOP


async def test_one_frame_per_step_carries_every_request(server):
    pool = ChannelPool("node-a")
    a, b = server.open("a"), server.open("b")
    conn = await pool.connection(server.address)
    assert await pool.connection(server.address) is conn  # one connection per ingress
    slot_a, slot_b = conn.open("a"), conn.open("b")
    frames: list[list] = []
    deliver = server.deliver
    server.deliver = lambda items: (frames.append(items), deliver(items))  # type: ignore[method-assign]

    slot_a.put(delta("a", 1), now=0.0)  # one engine step: both requests
    slot_b.put(delta("b", 1), now=0.0)
    assert (await a.get()).text == "t1"
    assert (await b.get()).text == "t1"
    assert [[item[0] for item in items] for items in frames] == [["a", "b"]]
    assert conn.kind == "unix" and server.accepted == {"unix": 1, "tcp": 0}  # same node

    slot_a.put(delta("a", 2, FinishReason.LENGTH), now=0.0)
    assert (await a.get()).finish_reason is FinishReason.LENGTH
    await asyncio.wait_for(slot_a.done, 1)  # resolved once the last delta is written
    assert not slot_b.done.done()
    pool.close()


async def test_a_paused_socket_merges_deltas_until_it_resumes(server):
    pool = ChannelPool("node-a")
    inbox = server.open("r")
    conn = await pool.connection(server.address)
    slot = conn.open("r")
    conn.pause_writing()  # the ingress stopped reading and the buffers are full
    for n in range(1, 4):
        slot.put(delta("r", n), now=float(n))
    await asyncio.sleep(0.02)
    assert slot.pending is not None and slot.pending.token_ids == [1, 2, 3]
    assert slot.pending_since == 1.0  # the oldest unread delta: what the stall cut reads
    conn.resume_writing()
    got = await inbox.get()
    assert got.token_ids == [1, 2, 3] and got.text == "t1t2t3"
    assert slot.pending is None
    pool.close()


async def test_a_whole_output_slot_sends_one_frame_at_the_end(server):
    pool = ChannelPool("node-a")
    inbox = server.open("r")
    conn = await pool.connection(server.address)
    slot = conn.open("r")
    slot.whole = True
    frames: list[list] = []
    deliver = server.deliver
    server.deliver = lambda items: (frames.append(items), deliver(items))  # type: ignore[method-assign]
    for n in range(1, 4):
        slot.put(delta("r", n), now=float(n))
        await asyncio.sleep(0.01)
    assert frames == [] and slot.pending is None  # nothing unread: no stall to cut either
    slot.put(delta("r", 4, FinishReason.STOP), now=4.0)
    got = await inbox.get()
    assert got.token_ids == [1, 2, 3, 4] and got.text == "t1t2t3t4" and got.finished
    assert len(frames) == 1
    await asyncio.wait_for(slot.done, 1)
    pool.close()


async def test_frames_split_anywhere_are_reassembled_and_unknown_ids_dropped(server):
    inbox = server.open("x")
    data = frame([encode_delta(delta("gone", 1))]) + frame(
        [encode_delta(delta("x", 1)), encode_delta(delta("x", 2))]
    )
    protocol = _InboundProtocol(server, "unix")
    data = server.secret + data
    for i in range(len(data)):  # one byte at a time
        protocol.data_received(data[i : i + 1])
    got = await inbox.get()
    assert got.token_ids == [1, 2]  # two deltas that arrived before the reader: merged


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff",  # a length past the limit
        frame([]).replace(b"[]", b"{]"),  # not JSON
        b"cos\nsystem\n(S'echo owned'\ntR.",  # a pickle: never unpickled, not even tried
    ],
)
async def test_a_corrupt_frame_closes_the_connection(server, garbage):
    closed = []

    class Transport:
        def close(self) -> None:
            closed.append(True)

    inbox = server.open("r")
    protocol = _InboundProtocol(server, "unix")
    protocol.connection_made(Transport())  # type: ignore[arg-type]
    protocol.data_received(server.secret + garbage + frame([encode_delta(delta("r", 1))]))
    assert closed == [True]
    assert inbox.pending is None  # nothing after the bad frame was delivered


async def test_a_peer_without_the_secret_is_dropped_before_any_frame(server):
    inbox = server.open("r")
    reader, writer = await asyncio.open_unix_connection(server.address.path)
    writer.write(b"x" * len(server.secret) + frame([encode_delta(delta("r", 1))]))
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the ingress
    writer.close()
    assert inbox.pending is None
    assert server.accepted == {"unix": 0, "tcp": 0}  # only peers with the secret count


async def test_losing_the_connection_fails_its_slots_and_the_pool_reconnects(server):
    pool = ChannelPool("node-a")
    conn = await pool.connection(server.address)
    slot = conn.open("r")
    conn.close()
    with pytest.raises(ChannelClosedError):
        await asyncio.wait_for(slot.done, 1)
    await until(lambda: conn.closed)
    with pytest.raises(ChannelClosedError):
        conn.open("s")
    again = await pool.connection(server.address)
    assert again is not conn and not again.closed
    inbox = server.open("s")
    again.open("s").put(delta("s", 1, FinishReason.STOP), now=0.0)
    assert (await inbox.get()).finish_reason is FinishReason.STOP
    pool.close()


async def test_replicas_on_other_nodes_use_tcp():
    server = ChannelServer()
    await server.start(ingress_id="ing-2", node_id="node-a", tcp_host="127.0.0.1")
    try:
        assert server.address.host == "127.0.0.1" and server.address.port
        pool = ChannelPool("node-b")  # another node: must not use the Unix socket path
        conn = await pool.connection(server.address)
        assert conn._transport.get_extra_info("peername")[0] == "127.0.0.1"
        inbox = server.open("t")
        conn.open("t").put(delta("t", 1), now=0.0)
        assert (await inbox.get()).token_ids == [1]
        assert conn.kind == "tcp" and server.accepted == {"unix": 0, "tcp": 1}
        (family,) = server.snapshot().values()  # what the ingress adds to /metrics
        assert family["type"] == "counter" and family["labels"] == ["transport"]
        assert {s["labels"][0]: s["value"] for s in family["series"]} == {"unix": 0, "tcp": 1}
        pool.close()
    finally:
        await server.stop()


async def test_a_request_id_can_be_open_only_once(server):
    server.open("dup")
    with pytest.raises(InvalidRequest):
        server.open("dup")
    server.close("dup")
    server.open("dup")
