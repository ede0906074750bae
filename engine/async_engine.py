"""AsyncEngine: the LLMEngine behind an asyncio interface, with one background step loop.

All engine work (adds, aborts, steps) runs on one dedicated thread, so the event loop only
hands over inputs and fans out deltas: it never blocks on torch. Each request's output is a
single merge slot, not a queue: when the reader keeps up it receives every step's delta the
moment it exists (the first token included); when it lags, new deltas merge into the pending
one (backpressure by coalescing, memory bounded by the request's own output). A reader that
leaves a delta unread for longer than `stall_timeout_s` is cut: its request is aborted and its
iterator raises `ReaderStalledError`. Closing an iterator early aborts its request within one
engine step, and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.protocol import QueueFullError
from engine.request import FinishReason, Request, TokenDelta


class ReaderStalledError(RuntimeError):
    """The consumer left output unread past the stall limit; the request was aborted."""


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """`a` followed by `b` as one delta (b's counters and finish reason win)."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return TokenDelta(
        request_id=b.request_id,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        finish_reason=b.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=b.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens,
        num_cached_tokens=b.num_cached_tokens,
        timings=b.timings,
        error=b.error or a.error,
    )


@dataclass(slots=True)
class _OutputSlot:
    """One request's pending output: at most one (merged) delta or an error."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: TokenDelta | None = None
    error: BaseException | None = None
    pending_since: float = 0.0
    num_coalesced: int = 0

    def put(self, delta: TokenDelta, now: float) -> None:
        if self.pending is None:
            self.pending = delta
            self.pending_since = now
        else:
            self.pending = merge_deltas(self.pending, delta)
            self.num_coalesced += 1
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def get(self) -> TokenDelta:
        while self.pending is None and self.error is None:
            self.event.clear()
            await self.event.wait()
        if self.pending is not None:
            delta, self.pending = self.pending, None
            return delta
        assert self.error is not None
        raise self.error


@dataclass(slots=True)
class _StepResult:
    deltas: list[TokenDelta]
    rejected: list[tuple[str, BaseException]]
    num_waiting: int
    ran: bool  # whether the step computed anything (false: nothing fits yet)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, stall_timeout_s: float = 30.0):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._slots: dict[str, _OutputSlot] = {}
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._num_waiting = 0  # as of the last step; read on the loop, written by _dispatch
        self.num_cancelled = 0
        self.num_stalled = 0

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine(config), **kwargs)

    # -- what the HTTP layer reads -----------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="firstlight-engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for slot in self._slots.values():
            slot.fail(RuntimeError("engine shut down"))
        self._executor.shutdown(wait=True)

    async def warmup(self) -> None:
        """One real forward pass on scratch blocks, off the event loop."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.runner.warmup)

    # -- EngineClient ------------------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncIterator[TokenDelta]:
        """Stream deltas for `request`. Raises ValueError / QueueFullError before the first."""
        if self._failure is not None:
            raise RuntimeError(f"engine loop failed: {self._failure!r}")
        if self._task is None:
            await self.start()
        self.engine.validate(request)
        rid = request.request_id
        if rid in self._slots:
            raise ValueError("request_id", f"request id {rid!r} is already running")
        if self._num_waiting + len(self._adds) >= self.engine.config.scheduler.max_waiting:
            raise QueueFullError(retry_after_s=self._retry_after_s())
        slot = self._slots[rid] = _OutputSlot()
        self._adds.append(request)
        self._kick()
        finished = False
        try:
            while True:
                delta = await slot.get()
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self._slots.pop(rid, None)
            if not finished:
                self.num_cancelled += 1
                self._aborts.append(rid)
                self._kick()

    async def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._kick()

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats["num_cancelled"] = self.num_cancelled
        stats["num_reader_stalls"] = self.num_stalled
        return stats

    # -- the loop ----------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _retry_after_s(self) -> float:
        """A rough wait for a waiting slot: one second per max_num_seqs queued requests."""
        cfg = self.engine.config.scheduler
        return max(1.0, cfg.max_waiting / max(1, cfg.max_num_seqs))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        try:
            while True:
                if not (self._adds or self._aborts or self.engine.has_unfinished()):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                result = await loop.run_in_executor(self._executor, self._step, adds, aborts)
                self._dispatch(result)
                if not result.ran and not (self._adds or self._aborts):
                    await asyncio.sleep(0.005)  # work is queued but nothing fits: don't spin
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine is broken: fail every open request
            self._failure = exc
            for slot in self._slots.values():
                slot.fail(RuntimeError(f"engine failure: {exc!r}"))
            raise

    def _step(self, adds: list[Request], aborts: list[str]) -> _StepResult:
        """Runs on the engine thread: apply inputs, then one engine step."""
        rejected: list[tuple[str, BaseException]] = []
        for rid in aborts:
            self.engine.abort(rid)
        for request in adds:
            try:
                self.engine.add_request(request)
            except (ValueError, QueueFullError) as exc:
                rejected.append((request.request_id, exc))
        steps = self.engine.counters.steps
        deltas = self.engine.step()
        waiting = sum(self.engine.scheduler.stats().waiting.values())
        return _StepResult(deltas, rejected, waiting, self.engine.counters.steps != steps)

    def _dispatch(self, result: _StepResult) -> None:
        now = time.monotonic()
        self._num_waiting = result.num_waiting
        for rid, exc in result.rejected:
            if (slot := self._slots.get(rid)) is not None:
                slot.fail(exc)
        for delta in result.deltas:
            slot = self._slots.get(delta.request_id)
            if slot is not None:
                slot.put(delta, now)
            elif not delta.finished:  # reader already gone: make sure the request dies
                self._aborts.append(delta.request_id)
        self._cut_stalled_readers(now)

    def _cut_stalled_readers(self, now: float) -> None:
        limit = self.stall_timeout_s
        for rid, slot in self._slots.items():
            if slot.pending is not None and slot.error is None and now - slot.pending_since > limit:
                self.num_stalled += 1
                self._aborts.append(rid)
                slot.fail(ReaderStalledError(f"reader stalled for more than {limit:.0f}s"))


__all__ = ["AsyncEngine", "FinishReason", "ReaderStalledError", "merge_deltas"]
