"""Runs batches: each JSONL line as a `bulk` request through the same OpenAI layer and
routing as HTTP, as fast as spare capacity allows, each result stored exactly once.

`BatchRunner.run_forever()` polls the store for active batches (also the ones a previous
runner left: a restarted runner resumes them) and runs each:

* validating → in_progress; lines whose results are stored already are skipped (they ran
  before a restart), the rest run with at most `capacity()` in flight (the cluster bulk
  throttle, `policies.bulk_throttle`: every seat of a replica with no interactive request,
  a small share of one serving some), so the batch fills the fleet when interactive load
  falls and backs off when it rises. Lines start in bunches, the capacity read before each:
  once 1/8 of it (at most `bunch`) is free, or when none is in flight, so the replica
  client can send a bunch in one Serve call (actors/replica_client.py);
* a line that is not valid JSON, lacks `custom_id`/`method`/`url`/`body`, names another
  endpoint, or is refused by the OpenAI layer (bad parameters, unknown model) becomes an
  entry of the error file; an overloaded engine (429) or a missing replica (503) makes the
  line wait and try again; the batch never fails because of a line;
* cancelling → cancelled, expired past `expires_at` → expired, else completed: the output
  and error files are written from the stored results (finished lines are kept);
* an input file that is gone (the API refuses to delete the input of an active batch, so
  only by hand) → failed, with the reason in `errors`; a run that raises anything else is
  logged and tried again after `FAILED_RETRY_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from app.batch.store import ACTIVE, BatchRow, BatchStore, new_id
from app.metric_snapshot import Snapshot, unlabelled
from app.openai.complete import complete
from app.openai.errors import APIError, to_api_error
from app.openai.prepare import OpenAILayer
from policies.request_class import CLASS_HEADER

logger = logging.getLogger("firstlight.batch")

RETRY_S = 0.5  # wait before retrying a line the engines could not take
FAILED_RETRY_S = 30.0  # wait before running again a batch whose run raised
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        layer: OpenAILayer,
        capacity: Callable[[int], int],
        *,
        poll_s: float = 0.5,
        bunch: int = 1,
    ) -> None:
        self.store = store
        self.layer = layer
        self.capacity = capacity
        self.poll_s = poll_s
        self.bunch = bunch
        self._running: dict[str, asyncio.Task] = {}
        self._retry_at: dict[str, float] = {}  # batch id -> monotonic time of its next try
        self._loop_task: asyncio.Task | None = None
        self.in_flight = 0
        self.lines_run = 0  # lines this runner sent to the engines (not counting retries)

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def snapshot(self) -> Snapshot:
        """Progress as metric families (merged into `/metrics` like any process's)."""
        family = unlabelled
        active = sum(1 for t in self._running.values() if not t.done())
        return {
            "firstlight_batch_lines_run": family(
                "counter", "Batch lines sent to the engines.", self.lines_run
            ),
            "firstlight_batch_lines_in_flight": family(
                "gauge", "Batch lines in the engines now.", self.in_flight
            ),
            "firstlight_batch_active": family("gauge", "Batches running now.", active),
        }

    def start(self) -> None:
        """Run `run_forever` in the background of the running loop (`stop` ends it)."""
        self._loop_task = asyncio.create_task(self.run_forever(), name="batch-runner")

    async def run_forever(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # the store being briefly locked must not stop the runner
                logger.exception("batch poll failed")
            await asyncio.sleep(self.poll_s)

    def poll(self) -> None:
        now = time.monotonic()
        active = self.store.active_batches()
        self._retry_at = {b.id: self._retry_at[b.id] for b in active if b.id in self._retry_at}
        for batch in active:
            task = self._running.get(batch.id)
            if (task is None or task.done()) and self._retry_at.get(batch.id, 0.0) <= now:
                task = asyncio.create_task(self.run_batch(batch.id), name=f"batch-{batch.id}")
                task.add_done_callback(functools.partial(self._ran, batch.id))
                self._running[batch.id] = task

    def _ran(self, batch_id: str, task: asyncio.Task) -> None:
        """A batch's run that raised (the store, say) is logged once and retried after
        `FAILED_RETRY_S`, not at every poll."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self._retry_at[batch_id] = time.monotonic() + FAILED_RETRY_S
        logger.error(
            "batch %s stopped on an error; retrying in %.0f s", batch_id, FAILED_RETRY_S,
            exc_info=exc,
        )  # fmt: skip

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(BaseException):
                await self._loop_task
        for task in self._running.values():
            task.cancel()
        for task in self._running.values():
            with contextlib.suppress(BaseException):
                await task
        self._running.clear()

    # -- one batch ---------------------------------------------------------------------------

    async def run_batch(self, batch_id: str) -> None:
        """Run the batch's remaining lines, then end it; a batch whose input file is gone
        (removed behind the API's back: the API refuses) fails with the reason."""
        try:
            await self._run_batch(batch_id)
        except FileNotFoundError:
            batch = self.store.get_batch(batch_id, None)
            if batch is None or self.store.file_path(batch.input_file_id).exists():
                raise  # another file: an error of this run, tried again later
            message = f"the input file {batch.input_file_id} no longer exists"
            logger.warning("batch %s failed: %s", batch_id, message)
            error = {"code": "input_file_missing", "message": message,
                     "param": "input_file_id", "line": None}  # fmt: skip
            self.store.set_status(batch_id, "failed", only_from=ACTIVE, errors=[error])

    async def _run_batch(self, batch_id: str) -> None:
        batch = self.store.get_batch(batch_id, None)
        if batch is None:
            return
        if batch.status == "validating":
            self.store.set_status(batch_id, "in_progress", only_from=("validating",))
        if batch.status in ("validating", "in_progress"):
            await self._run_lines(batch)
        batch = self.store.get_batch(batch_id, None)
        assert batch is not None
        if batch.status == "cancelling":
            self._finish(batch, "cancelled")
        elif batch.status in ("in_progress", "finalizing"):
            expired = time.time() > batch.expires_at
            self.store.set_status(batch_id, "finalizing", only_from=("in_progress",))
            self._finish(batch, "expired" if expired else "completed")

    async def _run_lines(self, batch: BatchRow) -> None:
        done = self.store.done_custom_ids(batch.id)
        path = self.store.file_path(batch.input_file_id)
        tasks: set[asyncio.Task] = set()
        wake = asyncio.Event()

        def finished(task: asyncio.Task) -> None:
            tasks.discard(task)
            self.in_flight -= 1
            wake.set()

        async def room() -> int:
            """Lines to start now (0: the batch is stopping), once enough are."""
            while True:
                capacity = self.capacity(self.in_flight)
                free = capacity - self.in_flight
                enough = 1 if not self.in_flight else max(1, min(self.bunch, capacity // 8))
                if self._stopping(batch.id):
                    return 0
                if free >= enough:
                    return free
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.poll_s)

        burst = 0
        try:
            with path.open("rb") as lines:
                for number, raw in enumerate(lines):
                    if not raw.strip():
                        continue
                    custom_id, line = _parse_line(raw)
                    if custom_id in done:
                        continue
                    if burst <= 0:
                        burst = await room()
                        if burst <= 0:
                            return
                    burst -= 1
                    self.in_flight += 1
                    task = asyncio.create_task(
                        self._run_line(batch, number, custom_id or f"line-{number}", line)
                    )
                    tasks.add(task)
                    task.add_done_callback(finished)
            while tasks:
                await asyncio.wait(set(tasks))
        finally:
            for task in set(tasks):
                task.cancel()

    def _stopping(self, batch_id: str) -> bool:
        """Cancelled by its owner, or past its completion window."""
        batch = self.store.get_batch(batch_id, None)
        return batch is None or batch.status == "cancelling" or time.time() > batch.expires_at

    async def _run_line(
        self, batch: BatchRow, number: int, custom_id: str, line: dict[str, Any] | str
    ) -> None:
        request_id = new_id("batch_req")
        if isinstance(line, str):  # the line itself is unusable: why
            self._error(batch, number, custom_id, request_id, "invalid_request", line)
            return
        if line["url"] != batch.endpoint:
            message = f"url {line['url']!r} is not this batch's endpoint {batch.endpoint!r}"
            self._error(batch, number, custom_id, request_id, "invalid_request", message)
            return
        self.lines_run += 1
        while True:
            try:
                job = await self.layer.prepare(
                    line["url"],
                    line["body"],
                    headers={CLASS_HEADER: "bulk"},
                    request_id=request_id,
                )
                if job.stream:
                    raise APIError(400, "a batch line cannot stream", param="stream")
                response = await complete(job)
            except Exception as exc:
                error = to_api_error(exc, request_id)
                if error.status in (429, 503):  # overloaded or no replica: the line waits
                    await asyncio.sleep(RETRY_S)
                    continue
                self._store(batch, number, custom_id, request_id, error.status, error.payload())
                return
            self._store(batch, number, custom_id, request_id, 200, response)
            return

    def _store(
        self,
        batch: BatchRow,
        number: int,
        custom_id: str,
        request_id: str,
        status: int,
        body: dict[str, Any],
    ) -> None:
        entry = {
            "id": request_id,
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
        self.store.record_result(batch.id, number, custom_id, status == 200, entry)

    def _error(
        self,
        batch: BatchRow,
        number: int,
        custom_id: str,
        request_id: str,
        code: str,
        message: str,
    ) -> None:
        entry = {
            "id": request_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
        self.store.record_result(batch.id, number, custom_id, False, entry)

    # -- the end -----------------------------------------------------------------------------

    def _finish(self, batch: BatchRow, status: str) -> None:
        """Write the output and error files from the stored results, then the final status.
        An expired batch's lines that never ran are error entries (`batch_expired`)."""
        if status == "expired":
            self._expire_rest(batch)
        fields: dict[str, Any] = {}
        for ok, name in ((True, "output_file_id"), (False, "error_file_id")):
            file_id = new_id("file")
            path = self.store.file_path(file_id)
            tmp = path.with_suffix(".part")
            count = size = 0
            with tmp.open("w", encoding="utf-8") as out:
                for body in self.store.results(batch.id, ok):
                    out.write(body + "\n")
                    count += 1
                    size += len(body.encode()) + 1
            if count:
                tmp.replace(path)
                suffix = "output" if ok else "error"
                self.store.add_file(
                    file_id, batch.owner, f"{batch.id}_{suffix}.jsonl", "batch_output", size, count
                )
                fields[name] = file_id
            else:
                tmp.unlink(missing_ok=True)
        self.store.set_status(batch.id, status, only_from=(*_ACTIVE_ENDS,), **fields)
        logger.info("batch %s %s", batch.id, status)

    def _expire_rest(self, batch: BatchRow) -> None:
        done = self.store.done_custom_ids(batch.id)
        with self.store.file_path(batch.input_file_id).open("rb") as lines:
            for number, raw in enumerate(lines):
                if not raw.strip():
                    continue
                custom_id = _parse_line(raw)[0] or f"line-{number}"
                if custom_id not in done:
                    message = "the batch expired before this line ran"
                    rid = new_id("batch_req")
                    self._error(batch, number, custom_id, rid, "batch_expired", message)


_ACTIVE_ENDS = ("in_progress", "finalizing", "cancelling", "validating")


def _parse_line(raw: bytes) -> tuple[str | None, dict[str, Any] | str]:
    """(custom_id, the line) or (custom_id if readable, why the line is unusable)."""
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"the line is not valid JSON: {exc}"
    if not isinstance(line, dict):
        return None, "the line is not a JSON object"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, "the line has no custom_id"
    if line.get("method") != "POST":
        return custom_id, "method must be POST"
    if line.get("url") not in ENDPOINTS:
        return custom_id, f"url must be one of {', '.join(ENDPOINTS)}"
    if not isinstance(line.get("body"), dict):
        return custom_id, "body must be a JSON object"
    return custom_id, line
