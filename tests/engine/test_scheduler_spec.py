"""Speculative tokens in the scheduler: scheduled with a decode when budget and blocks allow,
dropped (never preempting anyone) otherwise; rejected positions roll back their KV."""

from __future__ import annotations

from engine.sequence import Sequence
from tests.engine.sched_helpers import BLOCK, make_scheduler, make_seq


def decoding(sched, seq: Sequence) -> None:
    """Admit `seq`, compute its prompt and append one sampled token (it decodes next)."""
    sched.add(seq)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [seq]
    sched.update(out)
    seq.token_ids.append(7)


def test_drafts_ride_with_the_decode_and_accepted_ones_count_as_computed() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 20, max_tokens=50)
    decoding(sched, seq)
    seq.spec_token_ids = [11, 12, 13, 14]
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.spec_token_ids) == (20, 1, (11, 12, 13, 14))
    assert chunk.samples and out.num_batched_tokens == 5
    assert len(seq.block_ids) == 2  # positions 0..24
    # Two drafts accepted (appended by the engine with the correction token).
    seq.token_ids.extend([11, 12, 99])
    sched.update(out, {"a": 2})
    assert seq.num_computed_tokens == 23 == seq.num_tokens - 1


def test_drafts_are_cut_to_the_budget_max_tokens_and_context() -> None:
    sched = make_scheduler(max_num_batched_tokens=3)
    seq = make_seq("a", 10, max_tokens=50)
    sched.add(seq)
    for _ in range(4):  # 10-token prompt in 3-token chunks
        out = sched.schedule()
        sched.update(out)
    seq.token_ids.append(7)
    seq.spec_token_ids = [1, 2, 3, 4, 5]
    (chunk,) = sched.schedule().chunks
    assert chunk.spec_token_ids == (1, 2)  # 1 real token + 2 drafts fill the budget of 3

    sched = make_scheduler()
    seq = make_seq("b", 10, max_tokens=3)
    decoding(sched, seq)
    seq.spec_token_ids = [1, 2, 3, 4]
    (chunk,) = sched.schedule().chunks
    assert chunk.spec_token_ids == (1,)  # 1 output so far: 2 more tokens at most

    sched = make_scheduler(max_model_len=13)
    seq = make_seq("c", 10, max_tokens=50)
    decoding(sched, seq)
    seq.spec_token_ids = [1, 2, 3, 4]
    (chunk,) = sched.schedule().chunks
    assert chunk.spec_token_ids == (1, 2)  # positions 11 and 12 are the last in context


def test_drafts_are_dropped_rather_than_preempting_anyone() -> None:
    # 2 blocks: each sequence holds one (its prompt and first token fit), none is free.
    sched = make_scheduler(num_blocks=2, max_num_batched_tokens=64)
    a, b = make_seq("a", 10, arrival=0.0), make_seq("b", 10, arrival=1.0)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()
    sched.update(out)
    for seq in (a, b):
        seq.token_ids.append(7)
        seq.spec_token_ids = [1] * 8  # would need a second block each
    out = sched.schedule()
    assert [(c.seq.request_id, c.spec_token_ids) for c in out.chunks] == [("a", ()), ("b", ())]
    assert not out.preempted and sched.num_preemptions == 0


def test_rejected_drafts_return_their_blocks_and_are_never_cached() -> None:
    sched = make_scheduler(num_blocks=8)
    seq = make_seq("a", BLOCK - 1, max_tokens=50)
    decoding(sched, seq)  # 16 tokens, 15 computed, 1 block
    free0 = sched.kv.num_free_blocks
    seq.spec_token_ids = list(range(100, 100 + BLOCK + 4))  # drafts spill into 2 more blocks
    out = sched.schedule()
    assert len(seq.block_ids) == 3
    seq.token_ids.append(55)  # every draft rejected: only the correction token is new
    sched.update(out, {"a": 0})
    assert seq.num_computed_tokens == BLOCK
    assert len(seq.block_ids) == 1 and sched.kv.num_free_blocks == free0
    # The full first block (15 prompt tokens + the first sampled token) is cached; nothing
    # holding a rejected draft is.
    assert sched.kv.stats().num_cached_blocks == 1
