"""Batch jobs on a real Ray Serve with the demo model, through the OpenAI Python SDK: the
BatchJobs actor killed mid-batch is replaced, and the batch completes with every custom_id
exactly once in the output; its progress reaches `/metrics`."""

from __future__ import annotations

import io
import json
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.actors.helpers import serve_app, small_config

pytestmark = [pytest.mark.serve, pytest.mark.slow]

LINES = 24


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="fl-batch-") as directory:
        config = small_config(
            batch={"directory": directory},
            replica={"autoscaling": {"min_replicas": 1, "max_replicas": 1}},
            ingress={"sync_interval_s": 0.2},
        )
        with serve_app(config, namespace="firstlight-batch-tests") as url:
            yield url


def line(i: int) -> str:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Can I pause my subscription?"}],
        "max_tokens": 32,
        "ignore_eos": True,
        "temperature": 0,
    }
    return json.dumps(
        {"custom_id": f"k{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def test_killing_batch_jobs_mid_batch_still_answers_every_line_exactly_once(base_url) -> None:
    import ray

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    data = ("\n".join(line(i) for i in range(LINES)) + "\n").encode()
    file = client.files.create(file=("k.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 4:
        assert time.monotonic() < deadline, "the batch did not start"
        time.sleep(0.1)
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "firstlight_batch_lines_run_total" in metrics
    actor = next(
        a for a in ray.util.list_named_actors(all_namespaces=True) if "BatchJobs" in a["name"]
    )
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    assert client.batches.retrieve(batch.id).request_counts.completed < LINES  # mid-batch
    deadline = time.monotonic() + 180
    while (done := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, f"batch still {done.status}"
        time.sleep(0.3)
    assert done.request_counts.completed == LINES and done.request_counts.failed == 0
    assert done.output_file_id is not None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"k{i}" for i in range(LINES))
    assert all(o["response"]["status_code"] == 200 for o in out)
