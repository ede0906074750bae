"""The step scheduler, driven without a model: budgets, classes, preemption, aborts, leaks."""

from __future__ import annotations

import random

import pytest

from engine.errors import InvalidRequest
from engine.request import FinishReason, RequestClass
from engine.sched.order import StepOrderPolicy
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from tests.engine.sched_helpers import (
    BLOCK,
    FakeClock,
    fake_token,
    make_requests,
    make_scheduler,
    make_seq,
    run_step,
)

BULK = RequestClass.BULK
INTERACTIVE = RequestClass.INTERACTIVE


def chunk_sizes(out: SchedulerOutput) -> dict[str, int]:
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


# -- basics -------------------------------------------------------------------------------------


def test_prefill_then_decode_and_timings():
    clock = FakeClock(50.0)
    sched = make_scheduler(clock=clock)
    seq = make_seq("a", 40, max_tokens=3)
    sched.add(seq)
    assert seq.status is SequenceStatus.WAITING
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"a": 40} and out.chunks[0].start == 0
    assert seq.timings.first_scheduled == 50.0 and seq.status is SequenceStatus.RUNNING
    assert seq.num_computed_tokens == 40 and seq.num_tokens == 41
    assert len(seq.block_ids) == 3
    clock.now = 51.0
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"a": 1} and out.chunks[0].start == 40
    assert seq.timings.first_scheduled == 50.0
    _, finished = run_step(sched)
    assert finished == [seq] and seq.finish_reason is FinishReason.LENGTH
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule().is_empty


def test_add_rejects_bad_prompts_and_duplicates():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(InvalidRequest):
        sched.add(make_seq("long", 64))
    sched.add(make_seq("ok", 63))
    with pytest.raises(InvalidRequest):
        sched.add(make_seq("ok", 5))
    with pytest.raises(InvalidRequest):
        sched.add(make_seq("empty", []))
    small_pool = make_scheduler(num_blocks=2, max_model_len=4096)  # 32 token slots
    with pytest.raises(InvalidRequest):
        small_pool.add(make_seq("too-big-for-pool", 32))


def test_abort_frees_blocks_at_once_from_running_and_waiting():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    run_one, wait_one = make_seq("run", 50), make_seq("wait", 20)
    sched.add(run_one)
    sched.add(wait_one)
    out = sched.schedule()
    assert chunk_sizes(out) == {"run": 50} and sched.kv.num_free_blocks == 12
    assert sched.abort("run") is run_one  # between schedule and update
    assert sched.kv.num_free_blocks == 16 and run_one.block_ids == []
    assert run_one.finish_reason is FinishReason.ABORT and run_one.is_finished
    sched.update(out)  # the aborted chunk is ignored
    assert run_one.num_computed_tokens == 0
    assert sched.abort("wait") is wait_one and sched.abort("wait") is None
    assert sched.get("wait") is None and not sched.has_unfinished()
    assert sched.schedule().is_empty and sched.kv.num_free_blocks == 16


# -- budgets and seats --------------------------------------------------------------------------


def test_chunked_prefill_respects_the_token_budget_and_max_num_seqs():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=3)
    seqs = make_requests(5, 100)
    for seq in seqs:
        sched.add(seq)
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"r0": 64}  # one prompt takes the whole budget
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"r0": 36, "r1": 28}  # continues, then the next starts
    assert out.chunks[0].start == 64 and seqs[0].num_tokens == 101  # reached the end: sampled
    assert seqs[1].num_tokens == 100  # a cut chunk samples nothing
    steps = 2
    while sched.has_unfinished():
        out, _ = run_step(sched)
        steps += 1
        assert 0 < out.num_batched_tokens <= 64
        assert sched.num_running <= 3 and len(out.chunks) <= 3
        assert all(c.num_tokens > 0 for c in out.chunks)
        assert steps < 100
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)


def test_running_decodes_come_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=64, bulk_min_share=0.0)
    for seq in make_requests(3, 10):
        sched.add(seq)
    run_step(sched)
    sched.add(make_seq("big", 500, arrival=9.0))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"r0": 1, "r1": 1, "r2": 1, "big": 61}


def test_interactive_goes_first_and_bulk_keeps_its_share():
    sched = make_scheduler(max_num_batched_tokens=64, bulk_min_share=0.25)
    sched.add(make_seq("bulk", 100, cls=BULK, arrival=0.0))  # arrived first
    sched.add(make_seq("chat", 100, arrival=1.0))
    out, _ = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["chat", "bulk"]
    assert chunk_sizes(out) == {"chat": 48, "bulk": 16}
    # The reserve is capped by what bulk needs: a bulk decode holds back one token only.
    sched2 = make_scheduler(max_num_batched_tokens=64, bulk_min_share=0.25)
    sched2.add(make_seq("bulk", 8, cls=BULK))
    run_step(sched2)
    sched2.add(make_seq("chat", 100, arrival=1.0))
    out, _ = run_step(sched2)
    assert chunk_sizes(out) == {"chat": 63, "bulk": 1}


def test_bulk_takes_what_interactive_leaves():
    sched = make_scheduler(max_num_batched_tokens=64, bulk_min_share=0.1)
    sched.add(make_seq("chat", 10))
    sched.add(make_seq("bulk", 100, cls=BULK))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"chat": 10, "bulk": 54}


@pytest.mark.parametrize("share, bulk_done", [(0.25, True), (0.0, False)])
def test_bulk_progresses_under_a_continuous_interactive_stream(share, bulk_done):
    sched = make_scheduler(
        num_blocks=1024, max_num_batched_tokens=64, max_waiting=1000, bulk_min_share=share
    )
    bulk = make_seq("bulk", 100, cls=BULK, max_tokens=4)
    sched.add(bulk)
    for step in range(20):
        sched.add(make_seq(f"chat{step}", 200, arrival=float(step), max_tokens=2))
        out, _ = run_step(sched)
        interactive = sum(c.num_tokens for c in out.chunks if c.seq.request_class is INTERACTIVE)
        assert interactive >= 64 - int(64 * share)  # interactive keeps its priority
    assert bulk.is_finished is bulk_done


def test_bulk_keeps_a_seat_while_interactive_waits():
    sched = make_scheduler(max_num_seqs=4, bulk_min_share=0.25)
    for seq in make_requests(10, 4):
        sched.add(seq)
    sched.add(make_seq("bulk", 4, cls=BULK, arrival=99.0))
    out, _ = run_step(sched)
    assert set(chunk_sizes(out)) == {"r0", "r1", "r2", "bulk"}
    no_share = make_scheduler(max_num_seqs=4, bulk_min_share=0.0)
    for seq in make_requests(10, 4):
        no_share.add(seq)
    no_share.add(make_seq("bulk", 4, cls=BULK, arrival=99.0))
    out, _ = run_step(no_share)
    assert set(chunk_sizes(out)) == {"r0", "r1", "r2", "r3"}


# -- preemption ---------------------------------------------------------------------------------


def fill(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit and prefill `seqs` (block-aligned prompts fill their blocks exactly)."""
    for seq in seqs:
        sched.add(seq)
    out, _ = run_step(sched)
    assert {c.seq for c in out.chunks} == set(seqs)


def test_bulk_is_preempted_before_interactive_latest_arrival_first():
    sched = make_scheduler(num_blocks=7)
    chat = make_seq("chat", 48, arrival=5.0)
    early, late = make_seq("early", 32, cls=BULK, arrival=0.0), make_seq("late", 32, cls=BULK)
    late.request.arrival_time = 1.0
    fill(sched, chat, early, late)
    assert sched.kv.num_free_blocks == 0
    queued = make_seq("queued", 8, cls=BULK, arrival=10.0)
    sched.add(queued)
    out, _ = run_step(sched)  # every sequence needs one more block now
    assert out.preempted == [late]
    assert chunk_sizes(out) == {"chat": 1, "early": 1}
    assert late.status is SequenceStatus.WAITING and late.block_ids == []
    assert late.num_computed_tokens == 0 and late.num_preemptions == 1
    assert list(sched.waiting[BULK]) == [late, queued] and sched.num_preemptions == 1


def test_interactive_preempts_the_latest_interactive_then_itself():
    sched = make_scheduler(num_blocks=6)
    first, second = make_seq("first", 48, arrival=0.0), make_seq("second", 48, arrival=1.0)
    fill(sched, first, second)
    out, _ = run_step(sched)
    assert out.preempted == [second] and chunk_sizes(out) == {"first": 1}
    assert sched.waiting[INTERACTIVE][0] is second

    sched = make_scheduler(num_blocks=7)
    first, second = make_seq("first", 48, arrival=0.0), make_seq("second", 48, arrival=1.0)
    fill(sched, first, second)
    out, _ = run_step(sched)  # first takes the last free block; second has only itself
    assert out.preempted == [second] and chunk_sizes(out) == {"first": 1}


def test_bulk_never_preempts_interactive():
    sched = make_scheduler(num_blocks=7)
    chat = make_seq("chat", 48, arrival=5.0)
    bulk = make_seq("bulk", 48, cls=BULK, arrival=0.0)
    fill(sched, chat, bulk)
    out, _ = run_step(sched)
    assert out.preempted == [bulk] and chunk_sizes(out) == {"chat": 1}
    assert sched.schedule().preempted == []  # bulk waits; nothing else changes


def test_waiting_interactive_preempts_bulk_which_later_hits_its_own_blocks():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=256)
    bulk = make_seq("bulk", 64, cls=BULK, max_tokens=8)
    fill(sched, bulk)
    bulk_blocks = list(bulk.block_ids)
    chat = make_seq("chat", 100, arrival=1.0)  # needs 7 blocks; 6 are free
    sched.add(chat)
    out, _ = run_step(sched)
    assert out.preempted == [bulk] and chunk_sizes(out) == {"chat": 100}
    # The tail of bulk went first: its last block was taken, its first three stay cached.
    assert bulk_blocks[3] in chat.block_ids
    assert not set(bulk_blocks[:3]) & set(chat.block_ids)
    hits_before = sched.kv.stats().prefix_hits
    sched.finish(chat, FinishReason.STOP)
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"bulk": 65 - 48}
    assert bulk.block_ids[:3] == bulk_blocks[:3]
    assert sched.kv.stats().prefix_hits - hits_before == 48
    assert bulk.num_cached_tokens == 0  # counted on its first admission only


def test_waiting_interactive_does_not_preempt_bulk_in_vain():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=256)
    fill(sched, make_seq("chat0", 20), make_seq("bulk", 32, cls=BULK))
    sched.add(make_seq("huge", 150, arrival=9.0))  # 10 blocks: 6 free + 2 of bulk is short
    out, _ = run_step(sched)
    assert out.preempted == [] and chunk_sizes(out) == {"chat0": 1, "bulk": 1}
    assert sched.waiting[INTERACTIVE][0].request_id == "huge"


def test_victims_are_chosen_by_arrival_time_not_admission_order():
    sched = make_scheduler(num_blocks=5)
    young, old = make_seq("young", 32, cls=BULK, arrival=5.0), make_seq("old", 32, cls=BULK)
    chat = make_seq("chat", 16, arrival=9.0)
    fill(sched, young, old, chat)  # admitted young first, but old arrived first
    assert sched.kv.num_free_blocks == 0
    out, _ = run_step(sched)  # chat needs a second block
    assert out.preempted == [young]


# -- many random requests -----------------------------------------------------------------------


class KVTracker:
    """Records which token prefix each KV slot holds and checks every chunk's context."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    @staticmethod
    def prefix_keys(seq: Sequence) -> list[int]:
        keys, key = [], 0
        for t in seq.token_ids:
            key = hash((key, t))
            keys.append(key)
        return keys

    def run(self, seq: Sequence, start: int, n: int) -> None:
        keys = self.prefix_keys(seq)
        bs = self.block_size
        assert len(seq.block_ids) * bs >= start + n
        for p in range(start):  # the context attention would read
            assert self.slots.get((seq.block_ids[p // bs], p % bs)) == keys[p], (seq, p)
        for p in range(start, start + n):
            self.slots[(seq.block_ids[p // bs], p % bs)] = keys[p]


def test_random_workload_keeps_kv_consistent_and_leaks_nothing():
    run_random_workload()


def run_random_workload(order: StepOrderPolicy | None = None) -> None:
    """200 random requests sharing prefixes, random aborts: every chunk reads the K/V its
    context wrote, and everything is freed at the end (also run per step order)."""
    rng = random.Random(7)
    block_size, num_blocks = 4, 48
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=40,
        max_num_seqs=6,
        max_waiting=1000,
        bulk_min_share=0.2,
        max_model_len=160,
        order=order,
    )
    tracker = KVTracker(block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 25))] for _ in range(3)]
    todo = []
    for i in range(200):
        prompt = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(1, 30)))]
        cls = BULK if rng.random() < 0.3 else INTERACTIVE
        todo.append(make_seq(f"q{i}", prompt, cls=cls, arrival=i, max_tokens=rng.randrange(1, 25)))
    todo.reverse()
    aborted = finished = 0
    for _ in range(5000):
        for _ in range(rng.randrange(3)):
            if todo:
                sched.add(todo.pop())
        if rng.random() < 0.03 and sched.has_unfinished():
            live = [
                s.request_id for q in (*sched.waiting.values(), *sched.running.values()) for s in q
            ]
            victim = rng.choice(sorted(live))
            assert sched.abort(victim) is not None
            aborted += 1
        out = sched.schedule()
        ids = [c.seq.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)) and not set(ids) & {s.request_id for s in out.preempted}
        assert out.num_batched_tokens <= 40 and sched.num_running <= 6
        for chunk in out.chunks:
            assert chunk.num_tokens > 0 and chunk.start == chunk.seq.num_computed_tokens
            tracker.run(chunk.seq, chunk.start, chunk.num_tokens)
        sampled = [c.seq for c in out.chunks if c.samples]
        sched.update(out)
        for seq in sampled:
            seq.token_ids.append(fake_token(seq))
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
                finished += 1
        refs = [0] * num_blocks
        for seqs in sched.running.values():
            for seq in seqs:
                for b in seq.block_ids:
                    refs[b] += 1
        assert refs == [b.ref_count for b in sched.kv.pool.blocks]
        if not todo and not sched.has_unfinished():
            break
    assert not todo and not sched.has_unfinished()
    assert finished + aborted == 200
    kv = sched.kv.stats()
    assert kv.num_free == num_blocks and kv.usage == 0.0
    assert all(b.ref_count == 0 for b in sched.kv.pool.blocks)
    assert kv.prefix_hits > 0 and sched.num_preemptions > 0
    stats = sched.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_preemptions == sched.num_preemptions


def test_stats_count_per_class():
    sched = make_scheduler(max_num_seqs=2, bulk_min_share=0.0)
    for seq in make_requests(2, 8):
        sched.add(seq)
    sched.add(make_seq("b", 8, cls=BULK))
    run_step(sched)
    s = sched.stats()
    assert s.running == {"interactive": 2, "bulk": 0}
    assert s.waiting == {"interactive": 0, "bulk": 1}
    assert s.kv.num_free == s.kv.num_blocks - 2
    assert sched.kv.block_size == BLOCK
