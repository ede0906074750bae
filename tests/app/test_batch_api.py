"""Batch jobs in bare mode with the demo model, through the OpenAI Python SDK's files and
batches calls: every line answered exactly once (also after a restart mid-batch), bad lines
in the error file, cancel keeps finished results, and every refusal in the OpenAI schema."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.settings import Settings
from tests.actors.helpers import require_demo_model
from tests.app.helpers import live_server

pytestmark = pytest.mark.slow


def settings(directory: Path, **batch: Any) -> Settings:
    return Settings(
        engine={
            "cache": {"kv_cache_bytes": 16 << 20},
            "scheduler": {"max_num_seqs": 8, "max_waiting": 16},
        },
        batch={"directory": str(directory), **batch},
    )


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    require_demo_model()
    from app.standalone import build_standalone

    app = build_standalone(settings(tmp_path, max_lines=40, max_file_bytes=64 * 1024))
    async with live_server(app, lifespan="on") as url:
        yield url, tmp_path


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def line(custom_id: str, content: str = "Can I pause my subscription?", **body: Any) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 8,
                "temperature": 0,
                **body,
            },
        }
    )


def upload(client: openai.OpenAI, lines: list[str]) -> Any:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")


def wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


async def test_a_batch_through_the_sdk_answers_every_line_once(server) -> None:
    url, _ = server

    def run() -> None:
        client = sdk(url)
        good = [line(f"q{i}", ["hi", "what can you do?"][i % 2]) for i in range(12)]
        bad = [
            "not json at all",
            line("wrong-model", model="nope"),
            line("bad-param", max_tokens=-1),
            json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings",
                        "body": {}}),
        ]  # fmt: skip
        file = upload(client, good + bad)
        assert file.purpose == "batch" and file.bytes > 0
        assert client.files.retrieve(file.id).filename == "lines.jsonl"
        batch = client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert batch.status == "validating" and batch.request_counts.total == 16
        done = wait(client, batch.id, ("completed",))
        assert done.request_counts.completed == 12 and done.request_counts.failed == 4
        assert done.metadata == {"job": "nightly"}
        out = jsonl(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"q{i}" for i in range(12))
        for o in out:
            body = o["response"]["body"]
            assert o["response"]["status_code"] == 200 and body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["content"]
        errors = {e["custom_id"]: e for e in jsonl(client, done.error_file_id)}
        assert set(errors) == {"line-12", "wrong-model", "bad-param", "wrong-url"}
        assert errors["wrong-model"]["response"]["status_code"] == 404
        assert errors["bad-param"]["response"]["body"]["error"]["param"] == "max_tokens"
        assert "url" in errors["wrong-url"]["error"]["message"]
        page = client.batches.list(limit=1)
        assert page.data[0].id == batch.id
        assert [f.id for f in client.files.list().data].count(file.id) == 1
        assert client.files.delete(file.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file.id)

    await asyncio.to_thread(run)


async def test_cancel_stops_a_batch_and_keeps_what_finished(server) -> None:
    url, _ = server

    def run() -> None:
        client = sdk(url)
        file = upload(client, [line(f"c{i}", max_tokens=48, ignore_eos=True) for i in range(30)])
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.ConflictError) as in_use:  # the batch still reads it
            client.files.delete(file.id)
        assert in_use.value.body["param"] == "file_id" and batch.id in in_use.value.message
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = wait(client, batch.id, ("cancelled",), timeout=30)
        finished = jsonl(client, done.output_file_id)
        assert 2 <= len(finished) < 30
        assert len({o["custom_id"] for o in finished}) == len(finished)
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
        assert client.files.delete(file.id).deleted  # the batch has ended

    await asyncio.to_thread(run)


async def test_refusals_name_the_parameter(server) -> None:
    url, _ = server

    def run() -> None:
        client = sdk(url)
        with pytest.raises(openai.BadRequestError, match="more than 40 lines"):
            upload(client, [line(f"x{i}") for i in range(41)])
        with pytest.raises(openai.APIStatusError) as big:
            upload(client, [line("big", content="a" * 70_000)])
        assert big.value.status_code in (400, 413)
        with pytest.raises(openai.BadRequestError) as purpose:
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="assistants")
        assert purpose.value.body["param"] == "purpose"
        dup = upload(client, [line("same"), line("other"), line("same")])
        with pytest.raises(openai.BadRequestError, match="repeats custom_id 'same'") as repeat:
            client.batches.create(
                input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert repeat.value.body["param"] == "input_file_id"
        with pytest.raises(openai.NotFoundError):
            client.batches.create(
                input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError) as endpoint:
            client.batches.create(
                input_file_id=dup.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        assert endpoint.value.body["param"] == "endpoint"
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch-nope")

    await asyncio.to_thread(run)


async def test_a_restarted_server_resumes_and_runs_no_line_twice(tmp_path: Path) -> None:
    """The process dies mid-batch (its runner cancelled, results so far committed); a new
    one on the same directory finishes the batch with every custom_id exactly once."""
    require_demo_model()
    from app.standalone import build_standalone

    lines = [line(f"r{i}", max_tokens=24, ignore_eos=True) for i in range(16)]
    app = build_standalone(settings(tmp_path))
    async with live_server(app, lifespan="on") as url:

        def start() -> str:
            client = sdk(url)
            file = upload(client, lines)
            batch = client.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 60
            while client.batches.retrieve(batch.id).request_counts.completed < 3:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            return batch.id

        batch_id = await asyncio.to_thread(start)
    again = build_standalone(settings(tmp_path))
    async with live_server(again, lifespan="on") as url:

        def finish() -> None:
            client = sdk(url)
            done = wait(client, batch_id, ("completed",))
            assert done.request_counts.completed == 16 and done.request_counts.failed == 0
            ids = [o["custom_id"] for o in jsonl(client, done.output_file_id)]
            assert sorted(ids) == sorted(f"r{i}" for i in range(16))  # each exactly once

        await asyncio.to_thread(finish)
