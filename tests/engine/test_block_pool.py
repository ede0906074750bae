"""Block hashes and the block pool: chaining, determinism, ref counts, LRU eviction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.kv.block_hash import hash_block, hash_prefix_blocks, model_key
from engine.kv.block_pool import BlockPool

# -- hashes -------------------------------------------------------------------------------------


def test_hash_is_chained_on_the_parent_and_keyed():
    tokens = list(range(16))
    root = hash_block(None, tokens, 0)
    assert hash_block(None, tokens, 0) == root
    assert hash_block(root, tokens, 0) != root  # same tokens after a prefix: another block
    assert hash_block(0, tokens, 0) != root  # parent 0 is not "no parent"
    assert hash_block(None, tokens, 1) != root  # another model
    assert hash_block(None, tokens[::-1], 0) != root
    assert 0 <= root < 2**64


def test_hash_prefix_blocks_matches_the_chain_and_skips_the_partial_block():
    tokens = list(range(100, 150))  # 3 full blocks of 16 + 2 tokens
    hashes = hash_prefix_blocks(tokens, 16, extra_key=7)
    assert len(hashes) == 3
    parent = None
    for i, h in enumerate(hashes):
        parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16], 7)
        assert h == parent
    assert hash_prefix_blocks(tokens[:15], 16, 7) == []
    # A shared prefix gives shared leading hashes, then they diverge for good.
    other = tokens[:32] + [9] * 16
    assert hash_prefix_blocks(other, 16, 7)[:2] == hashes[:2]
    assert hash_prefix_blocks(other, 16, 7)[2] != hashes[2]


def test_hashes_are_the_same_in_another_process():
    code = (
        "from engine.kv.block_hash import hash_block, model_key;"
        "print(hash_block(None, [1, 2, 3], model_key('demo')))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert int(out.stdout) == hash_block(None, [1, 2, 3], model_key("demo"))
    assert model_key("demo") != model_key("demo-draft")


# -- pool ---------------------------------------------------------------------------------------


def test_allocate_and_free_track_ref_counts_and_usage():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.touch([a[0]])  # shared by a second sequence
    pool.free(a)
    assert pool.blocks[a[0]].ref_count == 1 and pool.num_free_blocks == 3
    pool.free([a[0]])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(AssertionError):
        pool.free([a[0]])
    with pytest.raises(MemoryError):
        pool.allocate(5)


def test_cached_free_blocks_are_evicted_in_lru_order_and_reused():
    pool = BlockPool(4, 16)
    old, new = pool.allocate(2), pool.allocate(2)
    for i, b in enumerate(old + new):
        assert pool.cache(b, 100 + i)
    pool.free(old)  # freed first: least recently used
    pool.free(new)
    assert pool.free_queue() == old + new
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    got = pool.allocate(1)
    assert got == [old[0]]
    assert pool.lookup(100) is None  # evicted: its hash is gone
    assert pool.blocks[old[0]].block_hash is None
    assert pool.lookup(101) == old[1] and pool.lookup(102) == new[0]


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3, 16)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, i)
    pool.free(blocks)
    hit = pool.lookup(1)
    assert hit == blocks[1]
    pool.touch([hit])
    assert hit not in pool.free_queue() and pool.num_free_blocks == 2
    assert pool.allocate(2) == [blocks[0], blocks[2]]  # the hit block survives
    assert pool.lookup(1) == blocks[1]


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, 16)
    cached, plain = pool.allocate(2), pool.allocate(1)
    pool.cache(cached[0], 1)
    pool.cache(cached[1], 2)
    pool.free(cached)
    pool.free(plain)  # holds nothing reusable: goes to the front
    assert pool.free_queue() == [plain[0], *cached]
    assert pool.allocate(1) == plain
    assert pool.num_cached_blocks == 2


def test_duplicate_hash_is_not_cached_twice():
    pool = BlockPool(2, 16)
    a, b = pool.allocate(2)
    assert pool.cache(a, 42)
    assert not pool.cache(b, 42)
    assert pool.lookup(42) == a and pool.blocks[b].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, 16)
    a = pool.allocate(1)
    pool.cache(a[0], 5)
    assert not pool.reset_prefix_cache()
    pool.free(a)
    assert pool.reset_prefix_cache()
    assert pool.lookup(5) is None and pool.num_cached_blocks == 0


def test_forget_hashes_drops_cached_blocks_in_use_too():
    pool = BlockPool(4, 16)
    held = pool.allocate(2)
    pool.cache(held[0], 11)
    pool.cache(held[1], 12)
    pool.free([held[1]])  # cached and free
    pool.forget_hashes()
    assert pool.lookup(11) is None and pool.lookup(12) is None
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 3
    assert pool.cache(held[0], 21)  # the held block can be cached again
    pool.free([held[0]])
