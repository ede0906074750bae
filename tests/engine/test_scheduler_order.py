"""The step scheduler under each step order: who is admitted, who gets budget, who is
preempted (the keys themselves are tested in tests/policies/test_step_order.py)."""

from __future__ import annotations

import random

import pytest

from engine.request import FinishReason, RequestClass
from engine.sched.order import StepOrderPolicy
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from policies.step_order import ClassPriority, EarliestDeadline, FirstComeFirstServed
from tests.engine.sched_helpers import fake_token, make_requests, make_scheduler, make_seq, run_step
from tests.engine.test_scheduler import run_random_workload

BULK = RequestClass.BULK
INTERACTIVE = RequestClass.INTERACTIVE


def chunk_sizes(out: SchedulerOutput) -> dict[str, int]:
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


def admitted(out: SchedulerOutput) -> list[str]:
    """Ids of the sequences whose first chunk this was, in the order they were served."""
    return [c.seq.request_id for c in out.chunks if c.start == c.seq.num_cached_tokens]


def with_deadline(seq: Sequence, deadline: float) -> Sequence:
    seq.request.deadline = deadline
    return seq


def fill(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit and prefill `seqs` in one step."""
    for seq in seqs:
        sched.add(seq)
    out, _ = run_step(sched)
    assert {c.seq for c in out.chunks} == set(seqs)


# -- fcfs ---------------------------------------------------------------------------------------


def test_fcfs_serves_an_earlier_bulk_before_a_later_interactive_when_seats_are_short():
    for order, first in ((FirstComeFirstServed(), "bulk"), (ClassPriority(), "chat")):
        sched = make_scheduler(max_num_seqs=1, order=order)
        sched.add(make_seq("chat", 20, arrival=1.0))
        sched.add(make_seq("bulk", 20, cls=BULK, arrival=0.0))
        out, _ = run_step(sched)
        assert admitted(out) == [first], order.name


def test_fcfs_reserves_neither_budget_nor_seats_for_bulk():
    sched = make_scheduler(
        max_num_batched_tokens=64, bulk_min_share=0.25, order=FirstComeFirstServed()
    )
    sched.add(make_seq("chat", 100, arrival=0.0))
    sched.add(make_seq("bulk", 100, cls=BULK, arrival=1.0))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"chat": 64}  # priority would give bulk its 16 (test_scheduler)

    sched = make_scheduler(max_num_seqs=4, bulk_min_share=0.25, order=FirstComeFirstServed())
    for seq in make_requests(10, 4):
        sched.add(seq)
    sched.add(make_seq("bulk", 4, cls=BULK, arrival=99.0))
    out, _ = run_step(sched)
    assert set(chunk_sizes(out)) == {"r0", "r1", "r2", "r3"}


def test_fcfs_admits_in_one_line_and_nothing_after_a_victim():
    # A blocked head holds up everything behind it, bulk or not.
    sched = make_scheduler(num_blocks=8, order=FirstComeFirstServed())
    fill(sched, make_seq("run", 64, arrival=0.0))  # 4 of 8 blocks
    sched.add(make_seq("huge", 100, arrival=1.0))  # 7 blocks: does not fit
    sched.add(make_seq("small", 8, cls=BULK, arrival=2.0))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"run": 1} and out.preempted == []
    # Priority admits the bulk one: its line is its own.
    sched = make_scheduler(num_blocks=8)
    fill(sched, make_seq("run", 64, arrival=0.0))
    sched.add(make_seq("huge", 100, arrival=1.0))
    sched.add(make_seq("small", 8, cls=BULK, arrival=2.0))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"run": 1, "small": 8}


# -- priority -----------------------------------------------------------------------------------


def test_priority_serves_interactive_first():
    sched = make_scheduler(max_num_seqs=1, bulk_min_share=0.0)
    sched.add(make_seq("bulk", 20, cls=BULK, arrival=0.0))
    sched.add(make_seq("chat", 20, arrival=29.0))  # arrived 29 s later: aging is 30 s
    out, _ = run_step(sched)
    assert admitted(out) == ["chat"]


def test_priority_admits_a_bulk_that_waited_longer_than_aging_s_before_a_new_interactive():
    def first_admitted(order: StepOrderPolicy, chat_arrival: float) -> list[str]:
        sched = make_scheduler(max_num_seqs=1, order=order)
        sched.add(make_seq("bulk", 20, cls=BULK, arrival=0.0))
        sched.add(make_seq("chat", 20, arrival=chat_arrival))
        return admitted(run_step(sched)[0])

    assert first_admitted(ClassPriority(aging_s=10.0), 11.0) == ["bulk"]
    assert first_admitted(ClassPriority(aging_s=10.0), 9.0) == ["chat"]
    assert first_admitted(ClassPriority(aging_s=None), 1e9) == ["chat"]  # strict


def test_an_aged_bulk_gets_its_chunk_before_a_newer_interactive_one():
    sched = make_scheduler(max_num_batched_tokens=64, order=ClassPriority(aging_s=10.0))
    sched.add(make_seq("bulk", 100, cls=BULK, arrival=0.0))
    sched.add(make_seq("chat", 100, arrival=20.0))
    out, _ = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["bulk"]  # it took the whole budget
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"bulk": 36, "chat": 28}


def test_interactive_work_stops_at_the_bulk_reserve_and_bulk_still_runs():
    sched = make_scheduler(max_num_batched_tokens=64, bulk_min_share=0.25)
    fill(sched, make_seq("a", 8, arrival=0.0), make_seq("b", 8, arrival=1.0))
    for seq in sched.running[INTERACTIVE]:
        seq.token_ids.extend(range(100))  # both have a long way to go again
    sched.add(make_seq("bulk", 100, cls=BULK, arrival=2.0))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"a": 48, "bulk": 16}


def test_an_interactive_request_takes_a_seat_from_bulk_beyond_its_share():
    sched = make_scheduler(max_num_seqs=4, bulk_min_share=0.25)  # bulk keeps 1 seat
    bulk = make_requests(4, 4, cls=BULK, prefix="b")
    fill(sched, *bulk)
    sched.add(make_seq("chat1", 4, arrival=10.0))
    out, _ = run_step(sched)
    assert out.preempted == [bulk[3]]  # the worst key: the latest bulk
    assert admitted(out) == ["chat1"] and bulk[3].status is SequenceStatus.WAITING
    for i in (2, 3):
        sched.add(make_seq(f"chat{i}", 4, arrival=10.0 + i))
    out, _ = run_step(sched)
    assert out.preempted == [bulk[2], bulk[1]] and admitted(out) == ["chat2", "chat3"]
    sched.add(make_seq("chat4", 4, arrival=20.0))  # bulk is down to its share: chat4 waits
    out, _ = run_step(sched)
    assert out.preempted == [] and "chat4" not in chunk_sizes(out)
    assert [s.request_id for s in sched.running[BULK]] == ["b0"]


def test_no_seat_is_taken_from_bulk_when_the_blocks_would_still_be_short():
    # 3 seats, 12 blocks: a chat holds 5, two bulk sequences 3 each; the new chat needs 8
    sched = make_scheduler(max_num_seqs=3, num_blocks=12, bulk_min_share=0.0)
    fill(sched, make_seq("chat0", 72, arrival=0.0), *make_requests(2, 40, cls=BULK, prefix="b"))
    sched.add(make_seq("big", 128, arrival=5.0))
    for _ in range(4):
        out, _ = run_step(sched)
        assert out.preempted == [] and "big" not in chunk_sizes(out)
    assert [s.request_id for s in sched.running[BULK]] == ["b0", "b1"]


@pytest.mark.parametrize(
    "order", [FirstComeFirstServed(), ClassPriority(aging_s=5.0)], ids=["fcfs", "aged"]
)
def test_no_seat_is_taken_from_bulk_ranked_first(order):
    # fcfs: one line, arrival order; priority with aging: these bulk requests waited longer
    # than aging_s before the chat arrived, so their keys rank before it.
    sched = make_scheduler(max_num_seqs=2, bulk_min_share=0.0, order=order)
    fill(sched, *make_requests(2, 4, cls=BULK, prefix="b"))
    sched.add(make_seq("chat", 4, arrival=10.0))
    out, _ = run_step(sched)
    assert out.preempted == [] and "chat" not in chunk_sizes(out)


# -- deadline -----------------------------------------------------------------------------------


def test_deadline_admits_the_earliest_deadline_first():
    def order_of(*seqs: Sequence) -> list[str]:
        sched = make_scheduler(max_num_seqs=1, order=EarliestDeadline(1.0, 30.0))
        for seq in seqs:
            sched.add(seq)
        served = []
        while sched.has_unfinished():
            out, _ = run_step(sched)
            served += admitted(out)
        return served

    # Deadlines: bulk 0 + 30 = 30, chat 10 + 1 = 11, late 40 + 1 = 41.
    bulk = make_seq("bulk", 8, cls=BULK, arrival=0.0, max_tokens=1)
    chat = make_seq("chat", 8, arrival=10.0, max_tokens=1)
    late = make_seq("late", 8, arrival=40.0, max_tokens=1)
    assert order_of(late, bulk, chat) == ["chat", "bulk", "late"]
    # An explicit earlier deadline wins over the class's target.
    bulk = with_deadline(make_seq("bulk", 8, cls=BULK, arrival=0.0, max_tokens=1), 5.0)
    chat = make_seq("chat", 8, arrival=10.0, max_tokens=1)
    late = with_deadline(make_seq("late", 8, arrival=40.0, max_tokens=1), 3.0)
    assert order_of(chat, bulk, late) == ["late", "bulk", "chat"]


def test_a_waiting_sequence_preempts_only_worse_keys():
    # Deadline: a waiting bulk request due first takes the blocks of a running interactive one.
    sched = make_scheduler(num_blocks=6, order=EarliestDeadline(1.0, 30.0))
    chat = make_seq("chat", 64, arrival=10.0)
    fill(sched, chat)
    urgent = with_deadline(make_seq("urgent", 64, cls=BULK, arrival=11.0), 10.5)
    sched.add(urgent)
    out, _ = run_step(sched)
    assert out.preempted == [chat] and chunk_sizes(out) == {"urgent": 64}
    # FCFS: a later interactive request does not preempt an earlier bulk one.
    sched = make_scheduler(num_blocks=6, order=FirstComeFirstServed())
    fill(sched, make_seq("bulk", 64, cls=BULK, arrival=0.0))
    sched.add(make_seq("chat", 64, arrival=1.0))
    out, _ = run_step(sched)
    assert out.preempted == [] and chunk_sizes(out) == {"bulk": 1}


# -- preemption and invariants, every order -----------------------------------------------------

ORDERS = {
    "fcfs": FirstComeFirstServed(),
    "priority": ClassPriority(aging_s=10.0),
    "strict": ClassPriority(aging_s=None),
    "deadline": EarliestDeadline(1.0, 30.0),
}


@pytest.mark.parametrize(
    ("order", "bulk_deadline", "victim"),
    [
        ("fcfs", None, "late"),  # keys: bulk 0, early 1, late 20
        ("priority", None, "late"),  # bulk 10, early 1, late 20
        ("strict", None, "bulk"),  # bulk inf
        ("deadline", None, "bulk"),  # bulk 30, early 2, late 21
        ("deadline", 0.5, "late"),  # bulk 0.5
    ],
)
def test_preemption_takes_the_worst_key(order, bulk_deadline, victim):
    sched = make_scheduler(num_blocks=10, order=ORDERS[order])
    bulk = make_seq("bulk", 48, cls=BULK, arrival=0.0)
    if bulk_deadline is not None:
        with_deadline(bulk, bulk_deadline)
    seqs = [bulk, make_seq("early", 48, arrival=1.0), make_seq("late", 48, arrival=20.0)]
    fill(sched, *seqs)  # 9 of 10 blocks; each needs one more now
    out, _ = run_step(sched)
    assert [s.request_id for s in out.preempted] == [victim]
    assert victim == max(seqs, key=lambda s: s.order_key).request_id
    assert set(chunk_sizes(out)) == {s.request_id for s in seqs} - {victim}
    assert sched.waiting[sched.get(victim).request_class][0].request_id == victim


@pytest.mark.parametrize("order", ["fcfs", "strict", "deadline"])
def test_random_workload_keeps_kv_consistent_under_every_order(order):
    run_random_workload(ORDERS[order])  # test_scheduler.py runs it under the default


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_every_step_follows_the_keys(order):
    """Chunks in key order; lists sorted by key; nothing admitted after a victim of its line."""
    rng = random.Random(3)
    sched = make_scheduler(
        num_blocks=40,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=5,
        max_waiting=1000,
        bulk_min_share=0.2,
        max_model_len=160,
        order=ORDERS[order],
    )
    todo = []
    for i in range(120):
        cls = BULK if rng.random() < 0.4 else INTERACTIVE
        seq = make_seq(f"q{i}", rng.randrange(1, 40), cls=cls, arrival=i / 2, max_tokens=20)
        if rng.random() < 0.2:
            with_deadline(seq, i / 2 + rng.uniform(0.0, 40.0))
        todo.append(seq)
    todo.reverse()
    preemptions = 0
    for _ in range(5000):
        if not todo and not sched.has_unfinished():
            break
        for _ in range(rng.randrange(3)):
            if todo:
                sched.add(todo.pop())
        waiting_before = {s for q in sched.waiting.values() for s in q}
        out = sched.schedule()
        keys = [c.seq.order_key for c in out.chunks]
        assert keys == sorted(keys) and not {c.seq for c in out.chunks} & set(out.preempted)
        for lists in (sched.running, sched.waiting):
            for q in lists.values():
                assert [s.order_key for s in q] == sorted(s.order_key for s in q)
        new = [c.seq for c in out.chunks if c.seq in waiting_before]
        for victim in out.preempted:
            same_line = [
                s
                for s in new
                if not sched.order.class_aware or s.request_class is victim.request_class
            ]
            assert all(s.order_key < victim.order_key for s in same_line)
        preemptions += len(out.preempted)
        sampled = [c.seq for c in out.chunks if c.samples]
        sched.update(out)
        for seq in sampled:
            seq.token_ids.append(fake_token(seq))
            if seq.num_output_tokens >= seq.sampling.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
    assert not todo and not sched.has_unfinished()
    assert preemptions > 0 and sched.kv.num_free_blocks == sched.kv.num_blocks


# -- a chat's first token without bulk rows -----------------------------------------------------


def test_the_step_of_a_chats_first_token_leaves_bulk_out_once() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, first_token_alone=True)
    fill(sched, make_seq("b0", 8, cls=BULK, max_tokens=40), make_seq("b1", 8, cls=BULK))
    sched.add(make_seq("chat", 12, arrival=1.0))
    out, _ = run_step(sched)
    assert chunk_sizes(out) == {"chat": 12}  # bulk's decode rows wait one step
    sched.add(make_seq("chat2", 12, arrival=2.0))
    out, _ = run_step(sched)  # another first token at once: bulk is not left out twice
    assert chunk_sizes(out) == {"chat": 1, "chat2": 12, "b0": 1, "b1": 1}
    out, _ = run_step(sched)  # decode steps carry bulk as before
    assert chunk_sizes(out) == {"chat": 1, "chat2": 1, "b0": 1, "b1": 1}


def test_a_left_out_bulk_chunk_comes_again_where_it_stood() -> None:
    """A bulk prompt admitted in the chat's step is left out and prefilled in the next one,
    from the same place and with the same blocks; its tokens match a run with no chat."""
    tokens = {}
    for with_chat in (False, True):
        sched = make_scheduler(max_num_batched_tokens=64, first_token_alone=True)
        fill(sched, make_seq("b0", 8, cls=BULK, max_tokens=6))
        sched.add(make_seq("b1", 20, cls=BULK, max_tokens=6))
        if with_chat:
            sched.add(make_seq("chat", 12, arrival=1.0, max_tokens=2))
        out, _ = run_step(sched)
        b1 = sched._seqs["b1"]
        if with_chat:
            assert chunk_sizes(out) == {"chat": 12}
            assert b1.status is SequenceStatus.RUNNING and b1.num_computed_tokens == 0
            blocks = list(b1.block_ids)
            out, _ = run_step(sched)
            assert chunk_sizes(out)["b1"] == 20 and b1.block_ids == blocks
        for _ in range(10):
            run_step(sched)
        tokens[with_chat] = b1.token_ids
        assert not sched.has_unfinished()
        assert sched.kv.stats().num_free == sched.kv.stats().num_blocks
    assert tokens[True] == tokens[False]


def test_first_token_alone_only_for_a_chats_last_prompt_chunk_and_only_when_on() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, bulk_min_share=0.25, first_token_alone=True)
    fill(sched, make_seq("b0", 8, cls=BULK, max_tokens=40))
    sched.add(make_seq("long", 40, arrival=1.0))  # in two chunks (bulk keeps its 8 of 32)
    out, _ = run_step(sched)
    assert "b0" in chunk_sizes(out) and chunk_sizes(out)["long"] < 40  # not its first token
    out, _ = run_step(sched)
    assert set(chunk_sizes(out)) == {"long"}  # the chunk that yields the first token

    for first_token_alone, order in ((False, None), (True, FirstComeFirstServed())):
        # off, or a class-blind order: the chat's first token shares the step with bulk
        sched = make_scheduler(first_token_alone=first_token_alone, order=order)
        fill(sched, make_seq("b0", 8, cls=BULK))
        sched.add(make_seq("chat", 12, arrival=1.0))
        out, _ = run_step(sched)
        assert set(chunk_sizes(out)) == {"chat", "b0"}
