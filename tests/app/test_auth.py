"""Optional API keys: 401 in the OpenAI error schema without a valid key on `/v1`, open
operator routes, keys from settings or a file, and files visible only to the key that
uploaded them."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.app.helpers import chat_body, live_server, make_app, make_client


async def test_no_keys_configured_means_no_key_needed(tmp_path: Path) -> None:
    app, _ = make_app(batch={"directory": str(tmp_path)})
    async with make_client(app) as client:
        assert (await client.get("/v1/models")).status_code == 200


async def test_v1_routes_need_a_valid_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# operators\nkey-from-file\n\n")
    app, _ = make_app(
        batch={"directory": str(tmp_path)},
        auth={"api_keys": ["key-a"], "api_keys_file": str(keys)},
    )
    async with make_client(app) as client:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic key-a"}):
            response = await client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            assert response.status_code == 401
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert response.headers["x-request-id"]
        for key in ("key-a", "key-from-file"):
            ok = await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        for open_path in ("/health", "/metrics", "/status", "/"):
            assert (await client.get(open_path)).status_code == 200, open_path


async def test_a_key_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    app, _ = make_app(batch={"directory": str(tmp_path)}, auth={"api_keys": ["alice", "bob"]})
    async with live_server(app) as url:
        alice = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0)
        bob = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bob", max_retries=0)
        line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
        file = await alice.files.create(file=("a.jsonl", line), purpose="batch")
        assert (await alice.files.retrieve(file.id)).id == file.id
        with pytest.raises(openai.NotFoundError):
            await bob.files.retrieve(file.id)
        with pytest.raises(openai.NotFoundError):
            await bob.files.content(file.id)
        assert [f.id for f in (await bob.files.list()).data] == []
        with pytest.raises(openai.NotFoundError):
            await bob.batches.create(
                input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
            )
        batch = await alice.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        )
        with pytest.raises(openai.NotFoundError):
            await bob.batches.retrieve(batch.id)
        assert [b.id for b in (await bob.batches.list()).data] == []
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="mallory", max_retries=0
            ).files.list()
