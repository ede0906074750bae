"""The DraftReplica on a real Ray Serve with the demo target and draft: greedy output is what
the target alone writes, responses report their drafts, /metrics counts them, and killing the
DraftReplica mid-stream costs no stream anything but speculation, which comes back with the
DraftReplica Serve starts in its place."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.actors.helpers import serve_app, small_config

pytestmark = [pytest.mark.serve, pytest.mark.slow]

PROMPT = "Can I pause my annual subscription?"
LONG = 600  # tokens of the streams the DraftReplica dies under


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    config = small_config(
        engine={
            "cache": {"kv_cache_bytes": 32 << 20},
            "speculative": {"method": "draft_model", "draft_model": "demo-draft"},
        },
        replica={"autoscaling": {"min_replicas": 1, "max_replicas": 1}},
        draft_replica={"host": "loopback", "timeout_s": 1.0, "address_refresh_s": 0.2},
    )
    with serve_app(config, namespace="firstlight-draft-tests") as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """What the target alone writes for PROMPT (greedy, in this process, no speculation)."""
    from demo.evaluate import chat_prompt
    from demo.paths import resolve_model
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams

    engine = LLMEngine(EngineConfig(model="demo"), resolve_model=resolve_model)
    ids = chat_prompt(engine.tokenizer, PROMPT)
    out = {"prompt": ids}
    for name, sampling in [
        ("text", SamplingParams(max_tokens=60, temperature=0)),
        ("long", SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)),
    ]:
        engine.add_request(Request(name, ids, sampling))
        text: list[str] = []
        while engine.has_unfinished():
            for delta in engine.step():
                text.append(delta.text)
        out[name] = "".join(text)
    assert len(out["text"]) > 40  # a real answer: several steps to speculate on
    return out


def body(reference: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {
        "model": "demo",
        "prompt": reference["prompt"],
        "max_tokens": 60,
        "temperature": 0,
        **kw,
    }


async def complete(client: httpx.AsyncClient, reference: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/completions", json=body(reference))
    assert response.status_code == 200, response.text
    return response.json()


async def wait_for_drafts(client: httpx.AsyncClient, reference: dict[str, Any]) -> dict:
    """A response that carried drafts (the replica finds the DraftReplica within ~1 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = await complete(client, reference)
        if out["firstlight"]["draft_tokens"] > 0:
            return out
        await asyncio.sleep(0.3)
    raise AssertionError("no response carried drafts")


async def test_drafts_from_the_draft_replica_keep_the_target_output(base_url, reference):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        out = await wait_for_drafts(client, reference)
        assert out["choices"][0]["text"] == reference["text"]
        usage = out["firstlight"]
        assert 0 < usage["accepted_tokens"] <= usage["draft_tokens"]
        metrics = (await client.get("/metrics")).text
        assert "firstlight_spec_decode_num_draft_tokens_total" in metrics
        assert "firstlight_spec_decode_num_accepted_tokens_per_pos_total{" in metrics


async def test_killing_the_draft_replica_mid_stream_costs_only_speculation(base_url, reference):
    import ray

    def draft_actor() -> Any:
        actor = next(
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "DraftReplica" in a["name"]
        )
        return ray.get_actor(actor["name"], namespace=actor["namespace"])

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        await wait_for_drafts(client, reference)

        started = [asyncio.Event() for _ in range(4)]
        done: list[bool] = [False] * 4

        async def stream(i: int) -> str:
            text = []
            request = body(reference, stream=True, max_tokens=LONG, ignore_eos=True)
            async with client.stream("POST", "/v1/completions", json=request) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        assert "error" not in chunk
                        text.extend(c["text"] for c in chunk["choices"])
                        started[i].set()
            done[i] = True
            return "".join(text)

        streams = [asyncio.create_task(stream(i)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
        ray.kill(draft_actor(), no_restart=True)
        assert not any(done)  # killed mid-stream
        texts = await asyncio.wait_for(asyncio.gather(*streams), timeout=180)
        assert texts == [reference["long"]] * 4  # every stream went on to the end, exact
        # Serve replaces the DraftReplica; the replica finds it, and speculation resumes.
        out = await wait_for_drafts(client, reference)
        assert out["choices"][0]["text"] == reference["text"]
