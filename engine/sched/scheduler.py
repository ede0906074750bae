"""The step scheduler: continuous batching, chunked prefill, two request classes, preemption.

Policy: interactive before bulk, and within a class running before waiting (FIFO by arrival),
in one token budget per step; bulk keeps a reserved share of budget and seats, so never starves.

There is no prefill phase. Each scheduled sequence catches `num_computed_tokens` up towards
`num_tokens` by a chunk: 1 token for a decode, up to the remaining budget for a prompt, which
continues next step when cut. A step is built in four passes over the token budget:

    1. running interactive      may preempt running bulk, then later-arrived interactive
                                (or itself)
    2. waiting interactive      may preempt running bulk to make room; FIFO, stops at the
                                first that does not fit
    3. running bulk             may preempt later-arrived bulk (or itself)
    4. waiting bulk             FIFO, stops at the first that does not fit

Passes 1-2 use at most `budget - reserve`, where `reserve` is `bulk_min_share` of the budget
capped at the bulk work that exists; passes 3-4 use the rest. While bulk waits, interactive
admission also leaves `ceil(bulk_min_share * max_num_seqs)` seats to bulk.

Preemption is by recompute: the victim frees its blocks (which stay cached, so re-admission
hits them) and returns to the front of its class's waiting queue; no waiting sequence of a
class that lost one this step is admitted in the same step (that would only thrash). The
running lists stay sorted by arrival, so a victim is always at a list's tail and never one
already scheduled in this step.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.errors import InvalidRequest
from engine.kv.cache_manager import KVCacheManager, KVCacheStats
from engine.request import FinishReason, RequestClass
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

_CLASSES = (RequestClass.INTERACTIVE, RequestClass.BULK)


@dataclass(slots=True)
class SchedulerStats:
    running: dict[str, int]  # per request class value
    waiting: dict[str, int]
    num_preemptions: int
    kv: KVCacheStats

    @property
    def num_running(self) -> int:
        return sum(self.running.values())

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())


@dataclass(slots=True)
class _Step:
    """What one `schedule()` call is building."""

    budget: int
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    preempted_classes: set[RequestClass] = field(default_factory=set)

    def add(self, seq: Sequence, n: int, spec: tuple[int, ...] = ()) -> None:
        self.out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, spec))
        self.budget -= n + len(spec)


def _arrival(seq: Sequence) -> float:
    return seq.request.arrival_time


class Scheduler:
    """Owns every unfinished sequence; the engine drives it once per step.

    `schedule()` → run the model on the chunks → append the new tokens (accepted drafts
    first) → `update(out, num_accepted)` → `finish()` the ones that stopped. `abort()` may
    come between any two calls.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if not 0.0 <= config.bulk_min_share <= 1.0:
            raise ValueError("bulk_min_share must be in [0, 1]")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: dict[RequestClass, deque[Sequence]] = {c: deque() for c in _CLASSES}
        self.running: dict[RequestClass, list[Sequence]] = {c: [] for c in _CLASSES}
        self.num_preemptions = 0
        self._seqs: dict[str, Sequence] = {}

    # -- intake and lookup ------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue `seq` at the back of its class. Whether it may wait at all is admission's
        decision (`engine.sched.admission`, made by the caller before this)."""
        n = seq.num_tokens
        if n == 0:
            raise InvalidRequest("prompt", "the prompt is empty")
        limit = min(self.max_model_len, self.kv.num_blocks * self.kv.block_size) - 1
        if n > limit:
            raise InvalidRequest("prompt", f"the prompt has {n} tokens; at most {limit} fit")
        if seq.request_id in self._seqs:
            raise InvalidRequest("request_id", f"request id {seq.request_id!r} is already in use")
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.request_class].append(seq)
        self._seqs[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return sum(len(r) for r in self.running.values())

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running={c.value: len(self.running[c]) for c in _CLASSES},
            waiting={c.value: len(self.waiting[c]) for c in _CLASSES},
            num_preemptions=self.num_preemptions,
            kv=self.kv.stats(),
        )

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        step = _Step(budget=cfg.max_num_batched_tokens)
        reserve = self._bulk_reserve()
        interactive_cap = cfg.max_num_batched_tokens - reserve
        seats = cfg.max_num_seqs - self._bulk_seat_reserve()
        used = self._schedule_running(RequestClass.INTERACTIVE, interactive_cap, step)
        self._admit(RequestClass.INTERACTIVE, interactive_cap - used, seats, step)
        self._schedule_running(RequestClass.BULK, step.budget, step)
        self._admit(RequestClass.BULK, step.budget, cfg.max_num_seqs, step)
        return step.out

    def update(self, out: SchedulerOutput, num_accepted: Mapping[str, int] | None = None) -> None:
        """Account the chunks the model just computed.

        `num_accepted[request_id]` is how many of a chunk's drafts were kept and are already
        appended to the sequence's `token_ids` (missing: none). Only their K/V counts as
        computed; blocks past the computed positions hold rejected drafts only and return to
        the pool, and a block holding a rejected position is never cached (only blocks whose
        every position is computed are).
        """
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished since schedule(): its blocks are gone
            assert chunk.start == seq.num_computed_tokens, "update() applied twice"
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.spec_token_ids:
                accepted = num_accepted.get(seq.request_id, 0) if num_accepted else 0
                assert 0 <= accepted <= len(chunk.spec_token_ids)
                seq.num_computed_tokens += accepted
                assert seq.num_computed_tokens <= seq.num_tokens, "accepted drafts not appended"
                self.kv.rollback(seq)
            self.kv.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire `seq` (running or waiting): its blocks return to the pool now."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running[seq.request_class].remove(seq)
        else:
            self.waiting[seq.request_class].remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        now = self.clock()
        if seq.timings.finished is None:
            seq.timings.finished = now
        self._seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    # -- passes -------------------------------------------------------------------------------

    def _schedule_running(self, cls: RequestClass, cap: int, step: _Step) -> int:
        """Give each running sequence of `cls` its next chunk; returns the tokens used."""
        running = self.running[cls]
        used = 0
        i = 0
        while i < len(running) and min(cap - used, step.budget) > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, cap - used, step.budget)
            if n <= 0:
                i += 1
                continue
            spec = (
                self._spec_tokens(seq, n, min(cap - used, step.budget) - n)
                if seq.spec_token_ids
                else ()
            )
            if spec and self.kv.allocate_slots(seq, n + len(spec)):
                step.add(seq, n, spec)
                used += n + len(spec)
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim(seq)
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                step.add(seq, n)
                used += n
                i += 1
        return used

    def _spec_tokens(self, seq: Sequence, n: int, budget: int) -> tuple[int, ...]:
        """The drafts of `seq` to compute after its `n` scheduled tokens: none unless the chunk
        reaches the end of the sequence; at most `budget`, and none past what the request may
        still output or past the context."""
        if not seq.spec_token_ids or seq.num_computed_tokens + n != seq.num_tokens:
            return ()
        room = min(
            budget,
            self.max_model_len - seq.num_tokens,
            seq.sampling.max_tokens - seq.num_output_tokens - 1,
        )
        return tuple(seq.spec_token_ids[: max(0, room)])

    def _pick_victim(self, seq: Sequence) -> Sequence:
        """The lowest-priority running sequence not yet scheduled: bulk first, latest first.

        Bulk never preempts interactive. Lists are sorted by arrival and scanned from the
        front, so the tail is `seq` itself or one not yet reached in this step.
        """
        bulk = self.running[RequestClass.BULK]
        if bulk:
            return bulk[-1]
        return self.running[seq.request_class][-1]

    def _admit(self, cls: RequestClass, cap: int, seats: int, step: _Step) -> None:
        """Admit waiting sequences of `cls` in FIFO order while budget, seats and blocks last."""
        if cls in step.preempted_classes:
            return
        queue = self.waiting[cls]
        used = 0
        while queue and self.num_running < seats and min(cap - used, step.budget) > 0:
            seq = queue[0]
            cached = self.kv.get_computed_blocks(seq)
            seq.num_computed_tokens = cached
            n = min(seq.num_tokens - cached, cap - used, step.budget)
            if not self.kv.allocate_slots(seq, n) and not self._preempt_bulk_for(seq, n, step):
                self.kv.free(seq)  # the cache hits it took; it stays first in line
                seq.num_computed_tokens = 0
                return
            queue.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = self.clock()
                seq.num_cached_tokens = cached
            bisect.insort(self.running[cls], seq, key=_arrival)
            step.add(seq, n)
            used += n

    def _preempt_bulk_for(self, seq: Sequence, n: int, step: _Step) -> bool:
        """Make room for a waiting interactive `seq` by preempting bulk, latest first.

        Preempts nothing when even every running bulk sequence's blocks would not suffice.
        """
        bulk = self.running[RequestClass.BULK]
        if seq.request_class is RequestClass.BULK or not bulk:
            return False
        held = sum(len(s.block_ids) for s in bulk)
        if self.kv.num_new_blocks(seq, n) > self.kv.num_free_blocks + held:
            return False
        while bulk:
            self._preempt(bulk[-1], step)
            if self.kv.allocate_slots(seq, n):
                return True
        return False

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        cls = seq.request_class
        self.running[cls].remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting[cls].appendleft(seq)
        self.num_preemptions += 1
        step.out.preempted.append(seq)
        step.preempted_classes.add(cls)

    # -- fairness and back-pressure -----------------------------------------------------------

    def _bulk_reserve(self) -> int:
        """Tokens held back from interactive work: the bulk share, capped at bulk demand."""
        share = self.config.bulk_min_share
        if share <= 0.0:
            return 0
        want = max(1, int(self.config.max_num_batched_tokens * share))
        demand = 0
        for seq in self.running[RequestClass.BULK]:
            demand += seq.num_tokens - seq.num_computed_tokens
            if demand >= want:
                return want
        # Waiting bulk counts only if it could be admitted now (a seat and a block are free).
        if self.num_running < self.config.max_num_seqs and self.kv.num_free_blocks > 0:
            for seq in self.waiting[RequestClass.BULK]:
                demand += seq.num_tokens
                if demand >= want:
                    return want
        return demand

    def _bulk_seat_reserve(self) -> int:
        """Seats interactive admission leaves free while bulk waits with fewer than its share."""
        share = self.config.bulk_min_share
        if share <= 0.0 or not self.waiting[RequestClass.BULK] or self.config.max_num_seqs < 2:
            return 0
        want = math.ceil(self.config.max_num_seqs * share)
        return max(0, want - len(self.running[RequestClass.BULK]))
