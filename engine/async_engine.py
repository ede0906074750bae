"""AsyncEngine: the LLMEngine behind an asyncio interface, with one background step loop.

All engine work (adds, aborts, steps) runs on one dedicated thread that steps back to back
while there is work and sleeps on a condition when there is none; the event loop only hands
over inputs (under a lock) and fans out the deltas the thread posts to it
(`call_soon_threadsafe`), so it never blocks on torch and the next step never waits for the
loop. Each request's output is a
single merge slot, not a queue: when the reader keeps up it receives every step's delta the
moment it exists (the first token included); when it lags, new deltas merge into the pending
one (backpressure by coalescing, memory bounded by the request's own output). A reader that
leaves a delta unread for longer than `stall_timeout_s` is cut: its request is aborted and its
iterator raises `ReaderStalledError`. Closing an iterator early aborts its request within one
engine step, and its KV blocks return to the pool.

Admission is decided on the event loop, in `attach`, by one `engine.sched.admission.Admission`:
a refused request raises `QueueFull` at once, without waiting for the engine thread. The loop
estimates the waiting queues (`num_waiting_by_class`) from the last dispatched step and the
requests attached since, and feeds the admission's drain meter with the finished deltas it
dispatches.

One exception to "one thread": a step that serves only bulk work while chat was served
within `EngineConfig.bulk_idle_priority_s` is handed to `engine.idle_runner.IdleRunner`, a
second thread at the OS's idle CPU priority, and the engine thread waits for it (steps never
overlap).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Mapping, Sized
from dataclasses import dataclass, replace
from typing import Any

from engine.config import EngineConfig
from engine.device import bind_thread
from engine.errors import InvalidRequest
from engine.idle_runner import IdleRunner
from engine.llm_engine import LLMEngine
from engine.models.resolve import ModelResolver, local_model_dir
from engine.request import Request, RequestClass, TokenDelta, merge_deltas
from engine.sched.admission import Admission
from engine.spec.proposer import Proposer
from engine.stats import ClassCounts, EngineStats, KVStats


class ReaderStalledError(RuntimeError):
    """The consumer left output unread past the stall limit; the request was aborted."""


class OutputSlot:
    """One request's pending output, where the engine puts it (on the event loop): at most
    one (merged) delta, or an error. `pending_since` (when the oldest unread delta arrived)
    lets the engine cut a stalled reader. `AsyncEngine.generate` reads it with `get`; other
    readers (the replica's token channel) subclass it. A `whole` slot (`attach` sets it from
    `Request.whole_output`) keeps the deltas back until the last one, then offers them as
    one."""

    __slots__ = ("_held", "error", "event", "pending", "pending_since", "whole")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.pending: TokenDelta | None = None
        self.pending_since = 0.0
        self.error: BaseException | None = None
        self.whole = False
        self._held: list[TokenDelta] = []

    def put(self, delta: TokenDelta, now: float) -> None:
        if self.whole:
            self._held.append(delta)
            if not delta.finished:
                return
            delta, self._held = merge_deltas(self._held), []
        if self.pending is None:
            self.pending = delta
            self.pending_since = now
        else:
            self.pending = merge_deltas([self.pending, delta])
        self.event.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self.event.set()

    async def get(self) -> TokenDelta:
        """The next (merged) delta; raises the error once every delta before it was read."""
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
    taken: ClassCounts  # adds this step took from the loop (accepted or rejected)
    waiting: ClassCounts  # the scheduler's queues after the step
    running: ClassCounts
    ran: bool  # whether the step computed or delivered anything (false: nothing fits yet)


def _counts(queues: Mapping[RequestClass, Sized]) -> ClassCounts:
    return ClassCounts(len(queues[RequestClass.INTERACTIVE]), len(queues[RequestClass.BULK]))


class AsyncEngine:
    """`stall_timeout_s` defaults to the engine config's; `admission` to one bounded by the
    scheduler's `max_waiting` and `interactive_reserve`."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        stall_timeout_s: float | None = None,
        admission: Admission | None = None,
    ):
        self.engine = engine
        config = engine.config
        self.stall_timeout_s = (
            config.stall_timeout_s if stall_timeout_s is None else stall_timeout_s
        )
        self.admission = admission or Admission(
            config.scheduler.max_waiting,
            interactive_reserve=config.scheduler.interactive_reserve,
        )
        self._slots: dict[str, OutputSlot] = {}
        # Inputs for the engine thread, guarded by _cond's lock.
        self._cond = threading.Condition()
        self._adds: list[Request] = []
        self._aborts: list[str] = []
        # Set when an interactive request is queued for the engine thread, cleared when that
        # thread takes the adds: a bulk-only step in progress stops for it (LLMEngine.step).
        self._interactive_added = False
        # Bulk-only steps within bulk_idle_priority_s of the last interactive request run on
        # the idle runner (CPU engines; EngineConfig.bulk_idle_priority_s).
        self._idle_window_s = config.bulk_idle_priority_s
        self._idle_runner: IdleRunner | None = None
        if self._idle_window_s > 0 and engine.runner.device.type == "cpu":
            self._idle_runner = IdleRunner()
        self._interactive_at = float("-inf")  # monotonic time the engine last held one
        self.num_idle_steps = 0  # steps run on the idle runner
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        # The loop's view of the waiting queues (read and written on the event loop only):
        # as of the last dispatched step, plus adds attached since that no step took yet.
        self._waiting = ClassCounts()
        self._running = ClassCounts()
        self._untaken = ClassCounts()
        self.num_cancelled = 0
        self.num_stalled = 0
        self.num_requests = ClassCounts()  # attached, per class (EngineStats.num_requests)
        # Wall-clock time a reader was first handed a delta (a replica clears it after its
        # warm-up request, so it dates the first token served: cold-start timing).
        self.first_delta_at: float | None = None

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        resolve_model: ModelResolver = local_model_dir,
        proposer: Proposer | None = None,
        **kwargs: Any,
    ) -> AsyncEngine:
        """`proposer` replaces the one `config.speculative` would build (e.g. a client of a
        DraftReplica)."""
        return cls(LLMEngine(config, resolve_model=resolve_model, proposer=proposer), **kwargs)

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

    @property
    def is_healthy(self) -> bool:
        return self._failure is None and (self._thread is None or self._thread.is_alive())

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(
                target=self._thread_main, name="firstlight-engine", daemon=True
            )
            self._thread.start()

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        if self._idle_runner is not None:
            self._idle_runner.shutdown()
        for slot in self._slots.values():
            slot.fail(RuntimeError("engine shut down"))

    async def warmup(self) -> None:
        """One real forward pass on scratch blocks, off the event loop (before start)."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.runner.warmup)

    # -- EngineClient ------------------------------------------------------------------------

    async def generate(self, request: Request) -> AsyncGenerator[TokenDelta, None]:
        """Stream deltas for `request`. Raises InvalidRequest / QueueFull before the first."""
        if self._thread is None:
            await self.start()
        slot = OutputSlot()
        self.attach(request, slot)
        finished = False
        try:
            while True:
                delta = await slot.get()
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self.detach(request.request_id, abort=not finished)

    def attach(self, request: Request, slot: OutputSlot) -> None:
        """Queue `request` with its output going to `slot` (the lower-level `generate`).
        Raises InvalidRequest / QueueFull / RuntimeError (engine not running) at once.
        Every attached request must be `detach`ed once its output is done with."""
        if self._failure is not None:
            raise RuntimeError(f"engine loop failed: {self._failure!r}")
        if self._thread is None:
            raise RuntimeError("the engine loop is not started")
        self.engine.validate(request)
        rid = request.request_id
        if rid in self._slots:
            raise InvalidRequest("request_id", f"request id {rid!r} is already running")
        self.admission.check(request.request_class, self.num_waiting_by_class)
        slot.whole = request.whole_output
        self._slots[rid] = slot
        self.num_requests = self.num_requests.plus(request.request_class, 1)
        self._untaken = self._untaken.plus(request.request_class, 1)
        self._submit(add=request)

    def check_admission(self, request_class: RequestClass, count: int) -> None:
        """`EngineClient.check_admission`: the admission decision for the first of `count`
        requests behind the other `count - 1` (`attach` decides each one again)."""
        untaken = self._untaken.plus(request_class, max(0, count - 1))
        self.admission.check(request_class, self._waiting_with(untaken))

    def release_admission(self, count: int) -> None:
        """`EngineClient.release_admission`: nothing to give back (`attach` counts each
        request when it comes)."""

    def detach(self, request_id: str, *, abort: bool) -> None:
        """Forget the request's slot; `abort` (its reader left early) also aborts the request
        within one engine step, returning its KV blocks."""
        if self._slots.pop(request_id, None) is not None and abort:
            self.num_cancelled += 1
            self._submit(abort=request_id)

    async def abort(self, request_id: str) -> None:
        self._submit(abort=request_id)

    @property
    def num_waiting_by_class(self) -> ClassCounts:
        """Waiting requests per class as admission sees them: those waiting after the last
        dispatched step, plus the requests attached since that the engine has not taken yet,
        less the seats (`max_num_seqs`) those will find free, interactive first. Seats count
        as free only while nothing waits (else something other than seats holds the queue).
        An estimate: the scheduler's queue may end up longer by at most the free seats (a
        step that cannot seat everyone, e.g. KV full) or the preemptions since that step."""
        return self._waiting_with(self._untaken)

    def _waiting_with(self, untaken: ClassCounts) -> ClassCounts:
        waiting = self._waiting
        free = 0
        if waiting.total == 0:
            free = max(0, self.engine.config.scheduler.max_num_seqs - self._running.total)
        seated_interactive = min(free, untaken.interactive)
        seated_bulk = min(free - seated_interactive, untaken.bulk)
        return ClassCounts(
            waiting.interactive + untaken.interactive - seated_interactive,
            waiting.bulk + untaken.bulk - seated_bulk,
        )

    def stats(self) -> EngineStats:
        sched = self.engine.scheduler.stats()
        counters = self.engine.counters
        return EngineStats(
            model=self.engine.model_name,
            running=ClassCounts.from_mapping(sched.running),
            waiting=ClassCounts.from_mapping(sched.waiting),
            kv=KVStats(
                num_blocks=sched.kv.num_blocks,
                num_free_blocks=sched.kv.num_free,
                usage=sched.kv.usage,
                prefix_cache_queries=sched.kv.prefix_queries,
                prefix_cache_hits=sched.kv.prefix_hits,
            ),
            admission=replace(
                self.admission.stats(), max_running=self.engine.config.scheduler.max_num_seqs
            ),
            num_preemptions=sched.num_preemptions,
            num_aborted=counters.aborted,
            num_steps=counters.steps,
            num_interrupted_steps=counters.interrupted_steps,
            generation_tokens=counters.generated_tokens,
            num_cancelled=self.num_cancelled,
            num_reader_stalls=self.num_stalled,
            num_requests=self.num_requests,
            spec=self.engine.spec_stats(),
            ttft_p95_interactive_s=self.engine.ttft.p95(RequestClass.INTERACTIVE),
            ttft_p95_bulk_s=self.engine.ttft.p95(RequestClass.BULK),
        )

    # -- the engine thread -------------------------------------------------------------------

    def _submit(self, add: Request | None = None, abort: str | None = None) -> None:
        with self._cond:
            if add is not None:
                self._adds.append(add)
                if add.request_class is RequestClass.INTERACTIVE:
                    self._interactive_added = True
                    if self._idle_runner is not None:
                        self._idle_runner.hurry()
            if abort is not None:
                self._aborts.append(abort)
            self._cond.notify()

    def _thread_main(self) -> None:
        loop = self._loop
        assert loop is not None
        bind_thread(self.engine.runner.device)
        idle_steps = 0
        posted = (ClassCounts(), ClassCounts())  # the queue sizes last posted to the loop
        try:
            while True:
                with self._cond:
                    while not (
                        self._stopping or self._adds or self._aborts or self.engine.has_unfinished()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    self._interactive_added = False
                idle = self._idle_runner if self._yields_cpu(adds) else None
                if idle is not None:
                    self.num_idle_steps += 1
                    result = idle.run(self._step, adds, aborts)
                else:
                    result = self._step(adds, aborts)
                queues = (result.waiting, result.running)
                if result.deltas or result.rejected or adds or queues != posted:
                    posted = queues
                    loop.call_soon_threadsafe(self._dispatch, result)
                # Work is queued but nothing fits yet (all blocks held): back off, don't spin.
                idle_steps = 0 if result.ran else idle_steps + 1
                if idle_steps:
                    with self._cond:
                        self._cond.wait(timeout=min(0.02, 0.001 * idle_steps))
        except BaseException as exc:  # the engine is broken: fail every open request
            self._failure = exc
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._fail_all, exc)

    def _yields_cpu(self, adds: list[Request]) -> bool:
        """Whether the next step serves bulk work only, within the idle window of the last
        interactive request the engine held (engine thread only: it reads the scheduler)."""
        if self._idle_runner is None:
            return False
        sched = self.engine.scheduler
        now = time.monotonic()
        if (
            sched.running[RequestClass.INTERACTIVE]
            or sched.waiting[RequestClass.INTERACTIVE]
            or any(a.request_class is RequestClass.INTERACTIVE for a in adds)
        ):
            self._interactive_at = now
            return False
        return now - self._interactive_at < self._idle_window_s

    def _interactive_waits(self) -> bool:
        """Whether an interactive request was queued since the engine thread last took the
        adds (read without the lock: a stale answer only delays the stop by one layer)."""
        return self._interactive_added

    def _step(self, adds: list[Request], aborts: list[str]) -> _StepResult:
        """Apply inputs, then one engine step (engine thread only)."""
        rejected: list[tuple[str, BaseException]] = []
        for rid in aborts:
            self.engine.abort(rid)
        taken = ClassCounts()
        for request in adds:
            taken = taken.plus(request.request_class, 1)
            try:
                self.engine.add_request(request)
            except InvalidRequest as exc:  # admission already decided: only validity is left
                rejected.append((request.request_id, exc))
        counters = self.engine.counters
        before = (counters.steps, counters.interrupted_steps)
        deltas = self.engine.step(self._interactive_waits)
        sched = self.engine.scheduler
        return _StepResult(
            deltas,
            rejected,
            taken,
            waiting=_counts(sched.waiting),
            running=_counts(sched.running),
            # stopped, or only landed a launched step's tokens: go on at once
            ran=bool(deltas) or (counters.steps, counters.interrupted_steps) != before,
        )

    # -- on the event loop -------------------------------------------------------------------

    def _fail_all(self, exc: BaseException) -> None:
        for slot in self._slots.values():
            slot.fail(RuntimeError(f"engine failure: {exc!r}"))

    def _dispatch(self, result: _StepResult) -> None:
        now = time.monotonic()
        self._waiting = result.waiting
        self._running = result.running
        taken = result.taken
        self._untaken = ClassCounts(
            self._untaken.interactive - taken.interactive, self._untaken.bulk - taken.bulk
        )
        for rid, exc in result.rejected:
            if (slot := self._slots.get(rid)) is not None:
                slot.fail(exc)
        finished = 0
        if self.first_delta_at is None and result.deltas:
            self.first_delta_at = time.time()
        for delta in result.deltas:
            finished += delta.finished
            slot = self._slots.get(delta.request_id)
            if slot is not None:
                slot.put(delta, now)
            elif not delta.finished:  # reader already gone: make sure the request dies
                self._submit(abort=delta.request_id)
        if finished:
            self.admission.record_finished(finished)
        self._cut_stalled_readers(now)

    def _cut_stalled_readers(self, now: float) -> None:
        limit = self.stall_timeout_s
        for rid, slot in self._slots.items():
            if slot.pending is not None and slot.error is None and now - slot.pending_since > limit:
                self.num_stalled += 1
                self._submit(abort=rid)
                slot.fail(ReaderStalledError(f"reader stalled for more than {limit:.0f}s"))
