"""The whole application on a real Ray Serve (127.0.0.1, the demo model), started once for
this module: OpenAI SDK with strict validation, raw SSE bytes, error statuses, overload,
client disconnects, slow readers, metrics from one scrape, and a replica dying.

Tests run in file order; the last one kills the model replica."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.messages import ReplicaStats
from tests.actors.helpers import serve_app, small_config
from tests.app.helpers import parse_sse

pytestmark = [pytest.mark.serve, pytest.mark.slow]

PROMPT = "Can I pause my annual subscription?"
STALL_S = 2.0  # engine stall limit in this module's config
TTL_S = 0.8  # a replica silent this long leaves the cluster view


def config(token_path: str) -> Any:
    return small_config(
        engine={"stall_timeout_s": STALL_S, "cache": {"kv_cache_bytes": 32 << 20}},
        max_body_bytes=64 * 1024,
        stall_timeout_s=STALL_S,
        replica={
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "max_queued_requests": 4,
            "stats_interval_s": 0.2,
            "health_check_period_s": 1.0,
        },
        ingress={"sync_interval_s": 0.2, "token_path": token_path},
        control_plane={"report_ttl_s": TTL_S},
    )


@pytest.fixture(scope="module", params=["channel", "stream"])
def base_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The app on real Ray Serve, once per token path (replica → ingress hop)."""
    with serve_app(config(request.param), namespace="firstlight-tests") as url:
        yield url


def replica_handle() -> Any:
    from ray import serve

    return serve.get_deployment_handle("ModelReplica", app_name="firstlight")


async def replica_stats() -> ReplicaStats:
    return await replica_handle().stats.remote()


def chat(**overrides: Any) -> dict[str, Any]:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "temperature": 0,
    }
    body.update(overrides)
    return body


async def scrape(client: httpx.AsyncClient) -> dict[str, dict[tuple, float]]:
    """/metrics as {sample name: {sorted label items: value}}."""
    text = (await client.get("/metrics")).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(metrics: dict[str, dict[tuple, float]], name: str) -> float:
    return sum(metrics.get(name, {}).values())


async def eventually(check: Any, timeout: float = 10.0, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(every)


def sdk(base_url: str, strict: bool = True) -> openai.AsyncOpenAI:
    """The official client. Strict validation suits chat; the SDK's `Completion` type has a
    non-optional `finish_reason`, which streamed completions (ours, OpenAI's) send as null."""
    return openai.AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=strict,
    )


# -- the OpenAI surface ----------------------------------------------------------------------


async def test_models_health_and_chat_through_the_sdk(base_url):
    client = sdk(base_url)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    async with httpx.AsyncClient(base_url=base_url) as http:
        assert (await http.get("/health")).status_code == 200

    reply = await client.chat.completions.create(**chat())
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 12

    stream = await client.chat.completions.create(
        **chat(), stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # greedy: same answer streamed
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert len({c.id for c in chunks}) == 1


async def test_the_proxy_port_serves_the_same_api(base_url):
    """Clients use the Ingress's own server; Serve's proxy (the fallback port) answers the
    same, and both send one x-request-id, the client's own when it sent one."""
    direct = await sdk(base_url).chat.completions.create(**chat())
    proxied = await sdk(base_url.proxy).chat.completions.create(**chat())
    assert proxied.choices[0].message.content == direct.choices[0].message.content  # greedy
    for url in (base_url, base_url.proxy):
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post(
                "/v1/chat/completions", json=chat(), headers={"x-request-id": "req-mine"}
            )
        assert r.status_code == 200, (url, r.text)
        assert r.headers.get_list("x-request-id") == ["req-mine"], url


async def test_a_json_schema_and_a_forced_tool_call_cross_ray(base_url):
    """The grammar travels with the request to the model replica, which enforces it."""
    client = sdk(base_url)
    schema = {
        "type": "object",
        "properties": {"plan": {"enum": ["free", "pro"]}, "seats": {"type": "integer",
                       "minimum": 1, "maximum": 50}},
        "required": ["plan", "seats"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema}}
    reply = await client.chat.completions.create(
        **chat(max_tokens=40, temperature=1.0, seed=3), response_format=fmt
    )
    value = json.loads(reply.choices[0].message.content or "")
    assert value["plan"] in ("free", "pro") and 1 <= value["seats"] <= 50
    tool = {"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string", "maxLength": 8}},
        "required": ["order_id"]}}}  # fmt: skip
    reply = await client.chat.completions.create(
        **chat(max_tokens=60), tools=[tool], tool_choice="required"
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "lookup_order"
    assert isinstance(json.loads(call.function.arguments)["order_id"], str)


async def test_completions_with_n_logprobs_and_stop(base_url):
    client = sdk(base_url, strict=False)
    eos = {"ignore_eos": True}
    plain = await client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=10, temperature=0, n=2, logprobs=2, extra_body=eos
    )
    assert sorted(c.index for c in plain.choices) == [0, 1]
    assert plain.choices[0].text == plain.choices[1].text  # greedy
    assert len(plain.choices[0].logprobs.tokens) == plain.usage.completion_tokens // 2
    assert all(len(top) <= 2 for top in plain.choices[0].logprobs.top_logprobs)

    words = plain.choices[0].text.split()
    stop = words[len(words) // 2]
    stopped = await client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop], extra_body=eos
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert plain.choices[0].text.startswith(stopped.choices[0].text)

    stream = await client.completions.create(
        model="demo",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=eos,
    )
    chunks = [c async for c in stream]
    for index in (0, 1):
        text = "".join(ch.text for c in chunks for ch in c.choices if ch.index == index)
        assert text == plain.choices[index].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


async def test_sse_bytes_are_exactly_framed(base_url):
    async with (
        httpx.AsyncClient(base_url=base_url) as client,
        client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert len(response.headers.get_list("x-request-id")) == 1
        body = b"".join([chunk async for chunk in response.aiter_raw()])
    events = parse_sse(body)
    assert events and all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_error_statuses_use_the_openai_schema(base_url):
    async with httpx.AsyncClient(base_url=base_url) as client:
        cases = [
            (400, await client.post("/v1/chat/completions", json=chat(temperature=-1))),
            (
                400,
                await client.post(
                    "/v1/chat/completions",
                    content=b"{not json",
                    headers={"content-type": "application/json"},
                ),
            ),
            (
                400,
                await client.post("/v1/completions", json={"model": "demo", "prompt": "x " * 5000}),
            ),
            (404, await client.post("/v1/chat/completions", json=chat(model="nope"))),
            (
                413,
                await client.post(
                    "/v1/completions", json={"model": "demo", "prompt": "y" * 70_000}
                ),
            ),
        ]
        for status, response in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
        assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200


async def test_no_bad_request_takes_the_replica_down(base_url):
    """Each request that once broke the engine or answered 500 gets a 4xx naming what is
    wrong, and the same replica then serves a normal request."""
    before = await replica_stats()
    nested = b'{"model": "demo", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    surrogate = b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}]}'
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        json_headers = {"content-type": "application/json"}
        cases = [
            ("seed", await client.post("/v1/chat/completions", json=chat(seed=2**70))),
            ("seed", await client.post("/v1/chat/completions", json=chat(seed=2**70, stream=True))),
            (None, await client.post("/v1/chat/completions", content=nested, headers=json_headers)),
            (
                "messages[0].content",
                await client.post("/v1/chat/completions", content=surrogate, headers=json_headers),
            ),
            (
                "n",
                await client.post(
                    "/v1/completions", json={"model": "demo", "prompt": ["a", "b", "c"], "n": 16}
                ),
            ),
            (
                "tool_choice",
                await client.post(
                    "/v1/chat/completions", json=chat(tools=[_TOOL], tool_choice=_UNKNOWN_TOOL)
                ),
            ),
            (
                "response_format.json_schema.schema",
                await client.post("/v1/chat/completions", json=chat(response_format=_BAD_SCHEMA)),
            ),
            (
                "logit_bias",
                await client.post("/v1/chat/completions", json=chat(logit_bias={"5": 10})),
            ),
        ]
        for param, response in cases:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            if param is not None:
                assert error["param"] == param, error
        after = await client.post("/v1/chat/completions", json=chat(seed=7))
        assert after.status_code == 200, after.text
    assert (await replica_stats()).replica_id == before.replica_id  # no restart


_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
_UNKNOWN_TOOL = {"type": "function", "function": {"name": "refund"}}
_BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}


# -- overload, disconnects, slow readers -----------------------------------------------------


async def test_a_flood_gets_429_and_the_replica_keeps_serving(base_url):
    before = await replica_stats()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        responses = await asyncio.gather(
            *(
                client.post("/v1/chat/completions", json=chat(max_tokens=48, ignore_eos=True))
                for _ in range(32)
            )
        )
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        rejected = [r for r in responses if r.status_code == 429]
        assert rejected and statuses.count(200) >= 4
        assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
        for r in rejected:
            assert r.headers["content-type"] == "application/json", (r.text, r.headers)
            assert r.json()["error"]["type"] == "rate_limit_error"
        after = await client.post("/v1/chat/completions", json=chat())
        assert after.status_code == 200, after.text
    assert (await replica_stats()).replica_id == before.replica_id  # no restart


async def test_client_closing_mid_stream_aborts_and_frees_kv(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        baseline = await scrape(client)
        kv_baseline = total(baseline, "firstlight_kv_cache_usage_perc")
        free_before = (await replica_stats()).engine.kv.num_free_blocks
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=400, ignore_eos=True)
        ) as r:
            chunks = r.aiter_raw()
            await anext(chunks)

            async def kv_in_use() -> bool:
                return total(await scrape(client), "firstlight_kv_cache_usage_perc") > kv_baseline

            assert await eventually(kv_in_use, timeout=5.0), "the scrape never showed the KV use"
        # The stream is closed here: the request must be aborted in the replica.

        async def settled() -> dict | None:
            metrics = await scrape(client)
            kv = total(metrics, "firstlight_kv_cache_usage_perc")
            cancelled = total(metrics, "firstlight_request_cancelled_total")
            done = kv <= total(baseline, "firstlight_kv_cache_usage_perc") and cancelled > total(
                baseline, "firstlight_request_cancelled_total"
            )
            return metrics if done else None

        assert await eventually(settled, timeout=10.0), "KV usage or cancel count did not settle"
        stats = await replica_stats()
        assert stats.engine.kv.num_free_blocks == free_before
        assert stats.engine.running.total == 0


async def test_a_slow_reader_does_not_hold_the_replica(base_url):
    """A client that reads one chunk and then sleeps past the stall limit.

    The replica never waits for it: deltas cross the hop as they are made, so generation
    finishes at full speed, the replica's memory stays flat and other clients are served.
    The answer (a few hundred tokens) fits in the proxy's and the sockets' buffers, so the
    reader, once awake, gets it whole."""
    rss_before = (await replica_stats()).rss_bytes
    body = chat(stream=True, max_tokens=300, ignore_eos=True)
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        chunks = r.aiter_raw()
        first = await anext(chunks)
        started = time.monotonic()
        quick = await client.post("/v1/chat/completions", json=chat(max_tokens=4))
        assert quick.status_code == 200 and time.monotonic() - started < 5.0

        async def generation_done() -> bool:
            return (await replica_stats()).engine.running.total == 0

        assert await eventually(generation_done, timeout=30.0)
        await asyncio.sleep(max(0.0, STALL_S * 1.5 - (time.monotonic() - started)))
        assert (await replica_stats()).rss_bytes - rss_before < 64 << 20
        rest = b"".join([c async for c in chunks])
    events = parse_sse(first + rest)
    assert not any("error" in e for e in events)
    assert sum(bool(e["choices"] and e["choices"][0]["delta"].get("content")) for e in events) > 1


@pytest.mark.parametrize("port", ["ingress", "proxy"])
async def test_a_stalled_reader_is_cut_and_its_requests_aborted(base_url, port, request):
    """A client that reads the headers and then nothing, with a tiny receive window, while
    its 4 choices stream long answers with 20 top logprobs per token (~10 MB in all).

    On the Ingress's own port, once the socket's buffers are full its `send` blocks past the
    stall limit. Through Serve's proxy (the fallback port), once the socket and the proxy's
    buffers are full the proxy stops taking the ingress's messages, and the oldest waits past
    the limit. Either way the ingress cuts the stream and every choice is aborted in the
    replica long before its max_tokens. (The proxy path is checked on one token path.)"""
    if port == "proxy":
        if request.node.callspec.params["base_url"] != "channel":
            pytest.skip("the proxy path is checked on the channel token path")
        base_url = base_url.proxy
    stats = await replica_stats()
    cancelled_before, generated_before = stats.engine.num_cancelled, stats.engine.generation_tokens
    async with httpx.AsyncClient(base_url=base_url) as client:
        metrics_before = total(await scrape(client), "firstlight_request_cancelled_total")
    body = chat(stream=True, n=4, max_tokens=1900, ignore_eos=True, logprobs=True, top_logprobs=20)
    payload = json.dumps(body).encode()
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        # ... and read nothing more.

        async def all_aborted() -> bool:
            stats = await replica_stats()
            running = stats.engine.running.total
            return running == 0 and stats.engine.num_cancelled - cancelled_before >= 4

        assert await eventually(all_aborted, timeout=60.0, every=0.25)
        generated = (await replica_stats()).engine.generation_tokens - generated_before
        assert generated < 4 * 1900  # cut (~5,300 here), not finished
        async with httpx.AsyncClient(base_url=base_url) as client:
            metrics = await scrape(client)
        assert total(metrics, "firstlight_request_cancelled_total") > metrics_before
    finally:
        writer.close()


async def test_one_scrape_covers_replicas_and_ingress(base_url, request):
    async with httpx.AsyncClient(base_url=base_url) as client:
        response = await client.get("/metrics")
        assert response.status_code == 200
        metrics = await scrape(client)
    replica_id = (await replica_stats()).replica_id
    kv = metrics["firstlight_kv_cache_usage_perc"]
    assert any(dict(labels).get("replica") == replica_id for labels in kv)
    assert total(metrics, "firstlight_time_to_first_token_seconds_count") >= 5
    assert total(metrics, "firstlight_request_success_total") >= 5
    # this ingress's own bulk gate (the control plane returns every ingress's but its own)
    assert "firstlight_bulk_gate_in_flight" in metrics
    assert "firstlight_bulk_gate_refused_total" in metrics

    connections = {
        dict(labels)["transport"]: value
        for labels, value in metrics.get("firstlight_token_channel_connections_total", {}).items()
    }
    if request.node.callspec.params["base_url"] == "channel":  # one node: the Unix socket
        assert connections["unix"] >= 1 and connections["tcp"] == 0
    else:
        assert connections == {}


def test_our_log_lines_reach_the_replicas_log_files(base_url):
    """The project's loggers write where Serve writes, in its format: the model replica's
    INFO line about its layer ops is in that replica's log file (without `route_logs` it
    reached no handler at all)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    lines = [
        line
        for path in logs.glob("replica_firstlight_ModelReplica_*.log")
        for line in path.read_text(errors="replace").splitlines()
        if "layer ops torch chosen" in line
    ]
    assert lines and all(line.startswith("INFO ") for line in lines), lines[:3]


# -- a replica dying (keep last: it replaces the model replica) ------------------------------


async def test_a_dead_replica_errors_the_stream_then_503_then_recovers(base_url):
    import ray

    old_id = (await replica_stats()).replica_id
    actor = next(
        a for a in ray.util.list_named_actors(all_namespaces=True) if "ModelReplica" in a["name"]
    )
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=2000, ignore_eos=True)
        ) as r:
            chunks = r.aiter_raw()
            await anext(chunks)
            ray.kill(handle, no_restart=True)
            rest = b"".join([c async for c in chunks])
        assert b'data: {"error"' in rest and rest.endswith(b"data: [DONE]\n\n")

        # Probe every 0.2 s without waiting for earlier probes: requests routed while the
        # dead replica is still listed wait in Serve for its replacement, while those sent
        # once it has left the cluster view are answered 503 at once.
        probes: list[asyncio.Task] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            probes.append(
                asyncio.create_task(client.post("/v1/chat/completions", json=chat(max_tokens=2)))
            )
            await asyncio.sleep(0.2)
            done = [p.result().status_code for p in probes if p.done() and not p.exception()]
            if 503 in done and 200 in done[done.index(503) :]:
                break
        statuses = [p.result().status_code for p in probes if p.done() and not p.exception()]
        for p in probes:
            p.cancel()
        assert 503 in statuses, statuses
        assert 200 in statuses[statuses.index(503) :], statuses  # recovered
        unavailable = next(
            p.result()
            for p in probes
            if p.done()
            and not p.cancelled()
            and not p.exception()
            and p.result().status_code == 503
        )
        assert unavailable.json()["error"]["code"] == "engine_unavailable"
    assert (await replica_stats()).replica_id != old_id
