"""KVCacheManager: prefix hits, chaining, the num_tokens-1 cap, eviction order, counters."""

from __future__ import annotations

import engine.kv.cache_manager as kvm
from engine.kv.block_hash import hash_prefix_blocks
from engine.kv.cache_manager import KVCacheManager
from tests.engine.sched_helpers import BLOCK, make_seq

SHARED = list(range(1000, 1000 + 3 * BLOCK))  # a 3-block system prompt


def prefill(kv: KVCacheManager, seq) -> int:
    """Admit `seq` and pretend its whole prompt was computed in one step."""
    cached = kv.get_computed_blocks(seq)
    seq.num_computed_tokens = cached
    assert kv.allocate_slots(seq, seq.num_tokens - cached)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return cached


def test_second_request_hits_the_shared_prefix():
    kv = KVCacheManager(32, BLOCK)
    a = make_seq("a", [*SHARED, 1, 2, 3, 4, 5])
    b = make_seq("b", [*SHARED, 9, 9, 9])
    assert prefill(kv, a) == 0
    assert prefill(kv, b) == 48
    assert b.block_ids[:3] == a.block_ids[:3]
    assert b.block_ids[3] != a.block_ids[3]
    assert all(kv.pool.blocks[x].ref_count == 2 for x in a.block_ids[:3])
    s = kv.stats()
    assert s.prefix_queries == a.num_tokens + b.num_tokens
    assert s.prefix_hits == 48
    assert s.num_free == 32 - 5 and s.num_blocks == 32


def test_same_block_tokens_after_another_prefix_do_not_hit():
    kv = KVCacheManager(32, BLOCK)
    block = list(range(16))
    prefill(kv, make_seq("a", [*([7] * BLOCK), *block, 1]))
    b = make_seq("b", [*([8] * BLOCK), *block, 1])
    assert prefill(kv, b) == 0
    c = make_seq("c", [*([7] * BLOCK), *block, 2])
    assert prefill(kv, c) == 32


def test_cached_tokens_are_capped_below_the_whole_sequence():
    kv = KVCacheManager(32, BLOCK)
    prefill(kv, make_seq("a", [*SHARED, 5]))
    exact = make_seq("exact", SHARED)  # 48 tokens, all cached: only 32 may be served
    assert prefill(kv, exact) == 32
    one_more = make_seq("more", [*SHARED, 6])
    assert prefill(kv, one_more) == 48


def test_failed_allocation_allocates_nothing_and_counts_the_query_once():
    kv = KVCacheManager(4, BLOCK)
    prefill(kv, make_seq("a", [*SHARED, 1]))  # holds all 4 blocks
    b = make_seq("b", [*SHARED, *range(40)])  # needs 3 hit blocks + 3 new
    for _ in range(3):  # the scheduler retries each step while it does not fit
        cached = kv.get_computed_blocks(b)
        b.num_computed_tokens = cached
        assert cached == 48
        assert not kv.allocate_slots(b, b.num_tokens - cached)
        assert len(b.block_ids) == 3
        kv.free(b)
    assert kv.stats().prefix_queries == 49 and kv.stats().prefix_hits == 0
    assert kv.num_free_blocks == 0


def test_evictable_cached_blocks_count_as_free():
    kv = KVCacheManager(4, BLOCK)
    a = make_seq("a", [*SHARED, 1])
    prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 3
    b = make_seq("b", list(range(64)))
    assert prefill(kv, b) == 0  # needs all 4 blocks: evicts every block of a
    assert kv.pool.num_cached_blocks == 4  # b's four full blocks
    kv.free(b)
    assert prefill(kv, make_seq("a2", [*SHARED, 1])) == 0


def test_lru_eviction_and_last_block_first():
    kv = KVCacheManager(8, BLOCK)
    old = make_seq("old", [*range(500, 548), 0])  # 3 full blocks + 1 partial
    new = make_seq("new", [*range(900, 948), 0])
    prefill(kv, old)
    prefill(kv, new)
    old_blocks = list(old.block_ids)
    kv.free(old)  # freed first: evicted first, its last block before its first
    kv.free(new)
    # The two partial blocks (no hash) come first, then old's blocks tail-first, then new's.
    queue = kv.pool.free_queue()
    assert queue[2:5] == [old_blocks[2], old_blocks[1], old_blocks[0]]
    grab = make_seq("grab", list(range(3 * BLOCK)))  # 3 blocks: 2 partial + old's last
    kv.get_computed_blocks(grab)
    assert kv.allocate_slots(grab, grab.num_tokens)
    assert old_blocks[2] in grab.block_ids  # evicted block reused
    old_hashes = hash_prefix_blocks(old.token_ids, BLOCK, 0)
    new_hashes = hash_prefix_blocks(new.token_ids, BLOCK, 0)
    assert [kv.pool.lookup(h) for h in old_hashes] == [old_blocks[0], old_blocks[1], None]
    assert all(kv.pool.lookup(h) is not None for h in new_hashes)
    kv.free(grab)
    assert prefill(kv, make_seq("old2", [*range(500, 548), 0])) == 32


def test_decode_blocks_are_cached_incrementally(monkeypatch):
    calls = []
    real = kvm.hash_block
    monkeypatch.setattr(kvm, "hash_block", lambda *a: calls.append(1) or real(*a))
    kv = KVCacheManager(16, BLOCK)
    seq = make_seq("s", list(range(20)))
    prefill(kv, seq)
    assert len(calls) == 1  # one miss to look up; the cache step reuses that hash
    seq.token_ids.append(0)  # the prompt's sampled token: not computed yet
    while seq.num_tokens < 64:  # decode steps: compute the last token, then append one
        assert kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        kv.cache_full_blocks(seq)
        seq.token_ids.append(seq.num_tokens)
    assert seq.num_computed_tokens == 63
    assert kv.stats().prefix_queries == 20  # counted at admission, not on every allocation
    assert len(calls) == 3  # one hash per full block, ever
    assert kv.pool.num_cached_blocks == 3  # the 4th block's last position is not computed
    twin = make_seq("twin", [*seq.token_ids, 1])
    assert prefill(kv, twin) == 48


def test_free_clears_blocks_and_keeps_them_cached():
    kv = KVCacheManager(8, BLOCK)
    a = make_seq("a", [*SHARED, 1])
    prefill(kv, a)
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 8 and kv.usage == 0.0
    assert prefill(kv, make_seq("a", [*SHARED, 1])) == 48


def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    prefill(kv, make_seq("a", [*SHARED, 1]))
    assert prefill(kv, make_seq("b", [*SHARED, 1])) == 0
    assert kv.pool.num_cached_blocks == 0
    assert kv.stats().prefix_queries == 0 and kv.stats().prefix_hits == 0


def test_extra_key_separates_models():
    a_kv = KVCacheManager(8, BLOCK, extra_key=1)
    b_kv = KVCacheManager(8, BLOCK, extra_key=2)
    seq = make_seq("a", [*SHARED, 1])
    prefill(a_kv, seq)
    prefill(b_kv, make_seq("b", [*SHARED, 1]))
    a_hashes = {b.block_hash for b in a_kv.pool.blocks} - {None}
    b_hashes = {b.block_hash for b in b_kv.pool.blocks} - {None}
    assert len(a_hashes) == 3 and not a_hashes & b_hashes
