"""The batch store and runner below HTTP: a result is stored once whoever records it, and a
batch past its completion window ends `expired` with its unrun lines as error entries."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from app.batch.runner import BatchRunner
from app.batch.store import BatchStore, FileInUse, new_id


def test_a_result_is_stored_once_and_counted_once(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = store.add_batch("", "file-x", "/v1/completions", "24h", 3600, 2, None)
    assert store.record_result(batch.id, 0, "a", True, {"n": 1})
    assert not store.record_result(batch.id, 0, "a", False, {"n": 2})  # a second runner
    again = BatchStore(tmp_path)  # another process on the same directory
    assert not again.record_result(batch.id, 0, "a", True, {"n": 3})
    row = again.get_batch(batch.id, None)
    assert row is not None and (row.completed, row.failed) == (1, 0)
    assert [json.loads(b) for b in again.results(batch.id, True)] == [{"n": 1}]
    assert store.get_batch(batch.id, "someone else") is None


def completion_lines(store: BatchStore, prefix: str, n: int) -> str:
    """An input file of `n` /v1/completions lines (custom ids prefix0, prefix1, ...)."""
    file_id = new_id("file")
    lines = [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
              "body": {}} for i in range(n)]  # fmt: skip
    store.file_path(file_id).write_text("".join(json.dumps(x) + "\n" for x in lines))
    store.add_file(file_id, "", f"{prefix}.jsonl", "batch", 1, n)
    return file_id


async def test_an_expired_batch_lists_its_unrun_lines_as_errors(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    file_id = completion_lines(store, "e", 3)
    batch = store.add_batch("", file_id, "/v1/completions", "1m", -1, 3, None)  # already past
    store.record_result(batch.id, 0, "e0", True, {"custom_id": "e0"})
    never_called: Any = None  # the runner never reaches the OpenAI layer for an expired batch
    await BatchRunner(store, never_called, lambda own: 4).run_batch(batch.id)
    done = store.get_batch(batch.id, None)
    assert done is not None and done.status == "expired" and "expired_at" in done.times
    assert (done.completed, done.failed) == (1, 2)
    assert done.error_file_id is not None
    errors = [json.loads(x) for x in store.file_path(done.error_file_id).read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("e1", "batch_expired"),
        ("e2", "batch_expired"),
    ]


def test_batches_fill_idle_engines_and_back_off_under_interactive_load() -> None:
    """The runner's capacity (as wired in bare mode and BatchJobs): its own lines count as
    the bulk already in the engines, other bulk does not leave it that room."""
    from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats
    from policies.bulk_throttle import SpareCapacity, bulk_room

    def stats(running: ClassCounts, waiting: ClassCounts | None = None) -> EngineStats:
        return EngineStats(
            model="m",
            running=running,
            waiting=waiting or ClassCounts(),
            kv=KVStats(10, 10, 0.0, 0, 0),
            admission=AdmissionStats(16, 4, None, max_running=32),
        )

    def capacity(throttle: SpareCapacity, engine: EngineStats, own: int) -> int:
        return own + bulk_room(throttle, {"": engine}, own)

    idle = SpareCapacity(busy_share=0.25, hold_s=0, queue_ahead=0)
    assert capacity(idle, stats(ClassCounts(bulk=20)), own=20) == 32  # its own lines
    assert capacity(idle, stats(ClassCounts(bulk=20)), own=5) == 17  # 15 bulk are others'
    assert capacity(idle, stats(ClassCounts(interactive=3, bulk=8)), own=8) == 8  # a quarter
    assert capacity(idle, stats(ClassCounts(interactive=32), ClassCounts(interactive=5)), 0) == 1


async def test_lines_start_in_bunches_once_an_eighth_of_the_capacity_is_free(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """So the replica client can send them in one Serve call (actors/replica_client.py)."""
    import asyncio
    from types import SimpleNamespace

    import app.batch.runner as runner_module

    store = BatchStore(tmp_path)
    file_id = completion_lines(store, "l", 40)
    batch = store.add_batch("", file_id, "/v1/completions", "24h", 3600, 40, None)
    started: list[str] = []
    release: dict[str, asyncio.Event] = {}

    class Layer:
        async def prepare(self, url: str, body: Any, *, headers: Any, request_id: str) -> Any:
            return SimpleNamespace(stream=False, request_id=request_id)

    async def complete(job: Any) -> dict[str, Any]:
        started.append(job.request_id)
        release[job.request_id] = event = asyncio.Event()
        await event.wait()
        return {"usage": {"completion_tokens": 1}}

    monkeypatch.setattr(runner_module, "complete", complete)
    runner = BatchRunner(store, Layer(), lambda own: 16, bunch=16)  # type: ignore[arg-type]
    task = asyncio.create_task(runner.run_batch(batch.id))

    async def settle() -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    await settle()
    assert len(started) == 16  # none in flight: every free place at once
    release[started[0]].set()
    await settle()
    assert len(started) == 16  # 1 free of 16: less than 1/8
    release[started[1]].set()
    await settle()
    assert len(started) == 18  # 2 free: both start together
    for _ in range(100):
        for event in release.values():
            event.set()
        await settle()
        if task.done():
            break
    await task
    done = store.get_batch(batch.id, None)
    assert done is not None and done.status == "completed" and done.completed == 40


def test_the_input_of_an_active_batch_cannot_be_deleted(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    file_id = completion_lines(store, "d", 2)
    batch = store.add_batch("", file_id, "/v1/completions", "24h", 3600, 2, None)
    with pytest.raises(FileInUse) as in_use:
        store.delete_file(file_id, "")
    assert in_use.value.batch_id == batch.id and store.file_path(file_id).exists()
    assert store.delete_file(file_id, "someone else") is False  # not theirs: not found
    store.set_status(batch.id, "cancelled")
    assert store.delete_file(file_id, "") is True and not store.file_path(file_id).exists()


@pytest.mark.parametrize("status", ["in_progress", "finalizing"])
async def test_a_batch_whose_input_is_gone_fails_once_with_the_reason(
    tmp_path: Path, status: str
) -> None:
    """Gone before its lines ran, or while it was finalizing past its window (expiring
    reads the input for the lines that never ran): failed either way, never stuck."""
    store = BatchStore(tmp_path)
    file_id = completion_lines(store, "g", 2)
    window = 3600 if status == "in_progress" else -1  # finalizing: already expired
    batch = store.add_batch("", file_id, "/v1/completions", "24h", window, 2, None)
    store.set_status(batch.id, status)
    store.file_path(file_id).unlink()  # behind the API's back
    runner = BatchRunner(store, None, lambda own: 4)  # type: ignore[arg-type]
    runner.poll()
    await asyncio.gather(*runner._running.values())
    failed = store.get_batch(batch.id, None)
    assert failed is not None and failed.status == "failed" and "failed_at" in failed.times
    assert failed.errors and failed.errors[0]["code"] == "input_file_missing"
    assert store.active_batches() == []  # nothing runs it again


async def test_a_run_that_raises_is_logged_once_and_retried_after_the_back_off(
    tmp_path: Path, caplog
) -> None:
    store = BatchStore(tmp_path)
    file_id = completion_lines(store, "r", 1)
    store.add_batch("", file_id, "/v1/completions", "24h", 3600, 1, None)
    runner = BatchRunner(store, None, lambda own: 4)  # type: ignore[arg-type]
    runs = 0

    async def broken(batch_id: str) -> None:
        nonlocal runs
        runs += 1
        raise sqlite3.OperationalError("database is locked")

    async def polls(n: int) -> None:
        for _ in range(n):
            runner.poll()
            await asyncio.gather(*runner._running.values(), return_exceptions=True)

    runner.run_batch = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="firstlight.batch"):
        await polls(3)  # one run, then the back-off holds
        assert runs == 1 and caplog.text.count("stopped on an error") == 1
        runner._retry_at = {k: time.monotonic() for k in runner._retry_at}  # back-off over
        await polls(1)
    assert runs == 2
