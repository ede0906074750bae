"""Batch jobs on a real Ray Serve with the demo model and API keys on, through the OpenAI
Python SDK: cancel keeps finished results; refusals name their parameter; a second key sees
none of the first key's files or batches; BatchJobs runs nicer than chat serving; and the
BatchJobs actor killed mid-batch is
replaced, the batch completing with every custom_id exactly once (its progress in
`/metrics`). The module kills BatchJobs last."""

from __future__ import annotations

import io
import json
import os
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
            batch={"directory": directory, "max_lines": 100},
            auth={"api_keys": ["alice", "bob"]},
            replica={"autoscaling": {"min_replicas": 1, "max_replicas": 1}},
            ingress={"sync_interval_s": 0.2},
            batch_jobs={"nice": 10},
        )
        with serve_app(config, namespace="firstlight-batch-tests") as url:
            yield url


def sdk(base_url: str, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


def upload(client: openai.OpenAI, lines: list[str]) -> Any:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("k.jsonl", io.BytesIO(data)), purpose="batch")


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


def test_cancel_keeps_finished_lines_and_refusals_name_the_parameter(base_url) -> None:
    client = sdk(base_url)
    file = upload(client, [line(i) for i in range(40)])
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    client.batches.cancel(batch.id)
    while (done := client.batches.retrieve(batch.id)).status != "cancelled":
        assert time.monotonic() < deadline + 60, done.status
        time.sleep(0.2)
    assert done.output_file_id is not None
    kept = client.files.content(done.output_file_id).text.splitlines()
    assert 2 <= len(kept) < 40
    with pytest.raises(openai.BadRequestError, match="more than 100 lines"):
        upload(client, [line(i) for i in range(101)])
    twice = upload(client, [line(1), line(1)])
    with pytest.raises(openai.BadRequestError) as repeat:
        client.batches.create(
            input_file_id=twice.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert repeat.value.body["param"] == "input_file_id"
    with pytest.raises(openai.AuthenticationError):
        sdk(base_url, key="mallory").files.list()


def test_a_second_key_sees_nothing_of_the_first(base_url) -> None:
    alice, bob = sdk(base_url), sdk(base_url, key="bob")
    file = upload(alice, [line(0)])
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(file.id)
    assert file.id not in [f.id for f in bob.files.list().data]
    assert file.id in [f.id for f in alice.files.list().data]
    assert not [b for b in bob.batches.list().data]


def _niceness(pid: int, tid: int | str | None = None) -> int:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_batch_jobs_yields_the_cpu_to_chat_serving(base_url) -> None:
    """Every thread of its process runs `batch_jobs.nice` (10 here) nicer than the same thread of
    a process serving chat. (Ray renices a worker's Python thread to 15 and leaves the
    threads it started before at 0, so 0 → 10 and 15 → 19, the limit.)"""
    import ray

    pids = {
        a["ActorClassName"].rsplit(":", 1)[-1]: a["Pid"]
        for a in ray.state.actors(actor_state_name="ALIVE").values()  # GCS, no dashboard
        if a["ActorClassName"].startswith("ServeReplica:")
    }

    def threads(pid: int) -> set[int]:
        return {_niceness(pid, tid) for tid in os.listdir(f"/proc/{pid}/task")}

    chat = threads(pids["Ingress"])
    assert threads(pids["ModelReplica"]) == chat and min(chat) < 19
    assert threads(pids["BatchJobs"]) == {min(19, n + 10) for n in chat}


def test_killing_batch_jobs_mid_batch_still_answers_every_line_exactly_once(base_url) -> None:
    import ray

    client = sdk(base_url)
    file = upload(client, [line(i) for i in range(LINES)])
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
