"""The step scheduler: continuous batching, chunked prefill, a pluggable order, preemption.

There is no prefill phase. Each scheduled sequence catches `num_computed_tokens` up towards
`num_tokens` by a chunk: 1 token for a decode, up to the remaining budget for a prompt, which
continues next step when cut.

Order: a `StepOrderPolicy` (engine/sched/order.py, named by `SchedulerConfig.policy`) keys
each sequence when it is added, once for its life; lower is served first. A step is one pass
over the running and waiting sequences merged in key order, in one token budget:

    running    gets its next chunk; short of blocks, it preempts the running sequence with
               the worst key, again and again, until its chunk fits or the worst is itself
               (then it is preempted and gets nothing this step)
    waiting    is admitted with its first chunk while seats, budget and blocks last; it may
               preempt running sequences with worse keys, worst first, but only when all
               of their blocks would make room. Short of a seat, an interactive one
               preempts running bulk with worse keys beyond bulk's seat share (class-aware
               orders). One that is not admitted closes its line: nothing ranked after it
               in that line is admitted this step

A class-aware order (`priority`, `deadline`) gives each request class a line of its own and
keeps bulk's reserve: `bulk_min_share` of the budget, capped at the bulk work that exists, is
held back from interactive sequences until bulk has used it, and while bulk waits interactive
admission leaves `ceil(bulk_min_share * max_num_seqs)` seats (less the running bulk) to bulk.
So bulk never starves. A class-blind order (`fcfs`) has one line and no reserve. Under strict
priority (`aging_s=None`) the pass is the old fixed order: running interactive, waiting
interactive, running bulk, waiting bulk, each by arrival.

Preemption is by recompute: the victim frees its blocks (which stay cached, so re-admission
hits them) and returns to the waiting queue at its key's place; nothing ranked after it in
its line is admitted in the same step (that would only thrash). The pass visits keys in
increasing order, so a victim (the worst key) is never one already scheduled in this step.
Running and waiting sequences are kept per request class, each list sorted by key (inserted
in place, never re-sorted), so per-class counts are at hand for stats and admission.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.errors import InvalidRequest
from engine.kv.cache_manager import KVCacheManager, KVCacheStats
from engine.request import FinishReason, RequestClass
from engine.sched.order import OrderKey, StepOrderPolicy, build_step_order
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

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
    """What one `schedule()` call is building, and where its pass stands."""

    budget: int
    bulk_tokens: int  # budget still held back from interactive work for bulk
    bulk_seats: int  # seats interactive admission still leaves to bulk
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    # Per class: the index in its running list of the next sequence the pass visits.
    next_running: dict[RequestClass, int] = field(
        default_factory=lambda: dict.fromkeys(_CLASSES, 0)
    )
    # Per class: the best key its admission line lost to preemption in this step; the
    # classes whose line is done.
    floor: dict[RequestClass, OrderKey] = field(default_factory=dict)
    closed: set[RequestClass] = field(default_factory=set)

    def add(self, seq: Sequence, n: int, spec: tuple[int, ...] = ()) -> None:
        self.out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, spec))
        self.budget -= n + len(spec)
        if self.bulk_tokens and seq.request.request_class is RequestClass.BULK:
            self.bulk_tokens = max(0, self.bulk_tokens - n - len(spec))


def _key(seq: Sequence) -> OrderKey:
    return seq.order_key


_LAST: OrderKey = (math.inf, math.inf, 2**63)  # after every key


class Scheduler:
    """Owns every unfinished sequence; the engine drives it once per step.

    `schedule()` → run the model on the chunks → append the new tokens (accepted drafts
    first) → `update(out, num_accepted)` → `finish()` the ones that stopped. `abort()` may
    come between any two calls. `order` defaults to the policy `config.policy` names.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        order: StepOrderPolicy | None = None,
    ):
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if not 0.0 <= config.bulk_min_share <= 1.0:
            raise ValueError("bulk_min_share must be in [0, 1]")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.order = order if order is not None else build_step_order(config)
        self._bulk_left_out = False  # the last step's bulk chunks were left out
        # Both sorted by key (`Sequence.order_key`).
        self.waiting: dict[RequestClass, list[Sequence]] = {c: [] for c in _CLASSES}
        self.running: dict[RequestClass, list[Sequence]] = {c: [] for c in _CLASSES}
        self.num_preemptions = 0
        self._seqs: dict[str, Sequence] = {}
        self._num_added = 0

    # -- intake and lookup ------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Key `seq` and queue it at its key's place. Whether it may wait at all is admission's
        decision (`engine.sched.admission`, made by the caller before this)."""
        n = seq.num_tokens
        if n == 0:
            raise InvalidRequest("prompt", "the prompt is empty")
        limit = min(self.max_model_len, self.kv.num_blocks * self.kv.block_size) - 1
        if n > limit:
            raise InvalidRequest("prompt", f"the prompt has {n} tokens; at most {limit} fit")
        if seq.request_id in self._seqs:
            raise InvalidRequest("request_id", f"request id {seq.request_id!r} is already in use")
        seq.order_key = self.order.key(seq, self._num_added)
        self._num_added += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting[seq.request_class], seq, key=_key)
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
        step = _Step(
            budget=self.config.max_num_batched_tokens,
            bulk_tokens=self._bulk_reserve(),
            bulk_seats=self._bulk_seat_reserve(),
        )
        while step.budget > 0:
            seq, until = self._next(step)
            if seq is None:
                break
            if seq.status is SequenceStatus.RUNNING:
                self._run(seq.request_class, until, step)
            else:
                self._admit(seq, step)
        return self._first_token_alone(step.out)

    def _first_token_alone(self, out: SchedulerOutput) -> SchedulerOutput:
        """`SchedulerConfig.first_token_alone`: leave the bulk chunks out of a step that
        yields an interactive request's first token (not twice in a row). A chunk left out
        keeps its sequence's place and blocks, and is scheduled again from where it stood
        (as after an interrupted step)."""
        left_out, self._bulk_left_out = self._bulk_left_out, False
        if left_out or not self.config.first_token_alone or not self.order.class_aware:
            return out
        interactive = [c for c in out.chunks if c.seq.request_class is RequestClass.INTERACTIVE]
        first_token = any(c.samples and c.seq.num_output_tokens == 0 for c in interactive)
        if first_token and len(interactive) < len(out.chunks):  # and bulk chunks to leave out
            out.chunks = interactive
            self._bulk_left_out = True
        return out

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

    def advance(self, out: SchedulerOutput) -> None:
        """`update` for a step launched before its tokens are known (the engine's
        `async_scheduling`; no drafts): its chunks count as computed now, so the next
        `schedule()` continues after them, and the blocks they filled are cached now, as
        `update` would, except one holding a sequence's `PLACEHOLDER` input (its token is
        still on the device): `commit(out)` of the step that samples it caches that one."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING:
                assert chunk.start == seq.num_computed_tokens and not chunk.spec_token_ids
                seq.num_computed_tokens += chunk.num_tokens
                known = seq.num_tokens - (seq.token_ids[-1] == PLACEHOLDER)
                self.kv.cache_full_blocks(seq, known)

    def commit(self, out: SchedulerOutput) -> None:
        """After a launched step's tokens are in the sequences: cache the blocks that waited
        for them (see `advance`)."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens <= seq.num_tokens:
                self.kv.cache_full_blocks(seq)

    def release(self, seq: Sequence) -> None:
        """A running sequence whose last token a launched step computes (async scheduling):
        its seat and blocks go back now, as they would once that step's tokens were in, so the
        next `schedule()` sees what a synchronous engine would. It stays unfinished (ENDING)
        until `finish`, when the token lands. The launched step still writes its last K/V
        into the freed blocks: the device runs that write before any later step's."""
        assert seq.status is SequenceStatus.RUNNING
        self.running[seq.request_class].remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.ENDING

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire `seq` (running, waiting or ending): its blocks return to the pool now."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running[seq.request_class].remove(seq)
        elif seq.status is SequenceStatus.WAITING:
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

    # -- the pass ---------------------------------------------------------------------------

    def _next(self, step: _Step) -> tuple[Sequence | None, OrderKey]:
        """The sequence with the least key among those the pass has not visited (running, or
        at the head of an admission line still open), and the least key of the other lists'
        next ones: the pass serves `seq`'s running list up to there without looking again.

        (A victim that joins a waiting list meanwhile may rank before that key; it is then
        refused when visited, as it would have been at its place.)
        """
        heads = []
        for cls in _CLASSES:
            running, i = self.running[cls], step.next_running[cls]
            if i < len(running):
                heads.append(running[i])
            if self.waiting[cls] and cls not in step.closed:
                heads.append(self.waiting[cls][0])
        if not heads:
            return None, _LAST
        heads.sort(key=_key)
        return heads[0], heads[1].order_key if len(heads) > 1 else _LAST

    def _line(self, cls: RequestClass) -> tuple[RequestClass, ...]:
        """The classes that share `cls`'s admission line."""
        return (cls,) if self.order.class_aware else _CLASSES

    def _run(self, cls: RequestClass, until: OrderKey, step: _Step) -> None:
        """Give the running sequences of `cls` their next chunks in key order, up to `until`;
        one short of blocks preempts the worst key, again and again, or at last itself."""
        running, i = self.running[cls], step.next_running[cls]
        held = step.bulk_tokens if cls is RequestClass.INTERACTIVE else 0  # fixed meanwhile
        while i < len(running) and running[i].order_key < until:
            room = step.budget - held
            if room <= 0:  # nothing more for this class in this step
                i = bisect.bisect_left(running, until, lo=i, key=_key)
                break
            seq = running[i]
            i += 1
            n = min(seq.num_tokens - seq.num_computed_tokens, room)
            if n <= 0:
                continue
            spec = self._spec_tokens(seq, n, room - n) if seq.spec_token_ids else ()
            if spec and self.kv.allocate_slots(seq, n + len(spec)):
                step.add(seq, n, spec)
                continue
            while not self.kv.allocate_slots(seq, n):
                # The worst key is `seq` or one not yet visited: preempting it moves no index.
                victim = max((r[-1] for r in self.running.values() if r), key=_key)
                self._preempt(victim, step)
                if victim is seq:
                    i -= 1  # its successor moved up
                    break
            else:
                step.add(seq, n)
        step.next_running[cls] = i

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

    def _admit(self, seq: Sequence, step: _Step) -> None:
        """Admit waiting `seq` (the head of its line) if it fits; else close its line."""
        cls = seq.request_class
        interactive = cls is RequestClass.INTERACTIVE
        room = step.budget - (step.bulk_tokens if interactive else 0)
        seats = self.config.max_num_seqs - (step.bulk_seats if interactive else 0)
        lost = step.floor.get(cls)
        short_of_seat = self.num_running >= seats
        if (
            (lost is not None and seq.order_key >= lost)
            or room <= 0
            or (short_of_seat and not interactive)
        ):
            step.closed.update(self._line(cls))
            return
        cached = self.kv.get_computed_blocks(seq)
        seq.num_computed_tokens = cached
        n = min(seq.num_tokens - cached, room)
        # short of a seat: one is freed only if the blocks could then be found too
        seated = not short_of_seat or (
            self._could_fit(seq, n) and self._free_seat(seq, seats, step)
        )
        if not seated or (
            not self.kv.allocate_slots(seq, n) and not self._preempt_for(seq, n, step)
        ):
            self.kv.free(seq)  # the cache hits it took; it stays first in line
            seq.num_computed_tokens = 0
            step.closed.update(self._line(cls))
            return
        self.waiting[cls].remove(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.timings.first_scheduled is None:
            seq.timings.first_scheduled = self.clock()
            seq.num_cached_tokens = cached
        # Its key lies between the visited running sequences' and the others'.
        i = bisect.bisect_right(self.running[cls], seq.order_key, key=_key)
        self.running[cls].insert(i, seq)
        step.next_running[cls] = i + 1
        if not interactive:
            step.bulk_seats = max(0, step.bulk_seats - 1)
        step.add(seq, n)

    def _free_seat(self, seq: Sequence, seats: int, step: _Step) -> bool:
        """Make a seat for waiting interactive `seq` by preempting running bulk sequences
        with worse keys, worst first (class-aware orders only), down to bulk's own share of
        the seats (`bulk_min_share`). An interactive request never waits for a seat that
        bulk holds beyond its share; an aged bulk sequence (a better key) keeps its seat."""
        if not self.order.class_aware:
            return False
        bulk = self.running[RequestClass.BULK]
        keep = math.ceil(self.config.max_num_seqs * self.config.bulk_min_share)
        while self.num_running >= seats:
            if len(bulk) <= keep or bulk[-1].order_key <= seq.order_key:
                return False
            self._preempt(bulk[-1], step)
        return True

    def _worse(self, seq: Sequence) -> list[Sequence]:
        """The running sequences whose keys rank after `seq`'s."""
        return [
            s
            for r in self.running.values()
            for s in r[bisect.bisect_right(r, seq.order_key, key=_key) :]
        ]

    def _could_fit(self, seq: Sequence, n: int, worse: list[Sequence] | None = None) -> bool:
        """Whether `seq`'s next `n` tokens fit in the free blocks plus those the running
        sequences with worse keys (`worse`, default `_worse(seq)`) hold, so preempting for
        it is not in vain."""
        held = sum(len(s.block_ids) for s in (self._worse(seq) if worse is None else worse))
        return self.kv.num_new_blocks(seq, n) <= self.kv.num_free_blocks + held

    def _preempt_for(self, seq: Sequence, n: int, step: _Step) -> bool:
        """Make room for waiting `seq` by preempting running sequences with worse keys,
        worst first. Preempts nothing when even all of their blocks would not suffice."""
        worse = self._worse(seq)
        if not worse or not self._could_fit(seq, n, worse):
            return False
        for victim in sorted(worse, key=_key, reverse=True):
            self._preempt(victim, step)
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
        bisect.insort(self.waiting[cls], seq, key=_key)
        self.num_preemptions += 1
        step.out.preempted.append(seq)
        for c in self._line(cls):
            step.floor[c] = min(step.floor.get(c, seq.order_key), seq.order_key)

    # -- fairness and back-pressure -----------------------------------------------------------

    def _bulk_reserve(self) -> int:
        """Tokens held back from interactive work: the bulk share, capped at bulk demand
        (none for a class-blind order)."""
        share = self.config.bulk_min_share
        if share <= 0.0 or not self.order.class_aware:
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
        if (
            share <= 0.0
            or not self.order.class_aware
            or not self.waiting[RequestClass.BULK]
            or self.config.max_num_seqs < 2
        ):
            return 0
        want = math.ceil(self.config.max_num_seqs * share)
        return max(0, want - len(self.running[RequestClass.BULK]))
