"""The prefix sketch: what the block pool holds, as versioned diffs a receiver can follow."""

from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.kv.sketch import HeldBlocks, PrefixSketch


def cached_pool(sketch: PrefixSketch, n: int = 4) -> BlockPool:
    return BlockPool(n, 16, sketch)


def test_the_pool_reports_what_it_caches_and_evicts():
    sketch = PrefixSketch(extra_key=7)
    pool = cached_pool(sketch)
    blocks = pool.allocate(2)
    assert pool.cache(blocks[0], 101) and pool.cache(blocks[1], 102)
    first = sketch.take()
    assert sorted(first.added) == [101, 102] and first.removed == ()
    assert (first.base, first.version, first.extra_key) == (0, 1, 7)
    assert sketch.take().empty  # nothing changed since
    pool.free(blocks)  # freed blocks stay cached (and in the sketch) until reused
    assert sketch.take().empty
    pool.allocate(4)  # takes every block: both cached ones are evicted
    second = sketch.take()
    assert sorted(second.removed) == [101, 102] and second.added == ()
    assert (second.base, second.version) == (1, 2)
    assert len(sketch) == 0


def test_a_hash_cached_and_evicted_between_takes_nets_out():
    sketch = PrefixSketch()
    pool = cached_pool(sketch, n=1)
    (block,) = pool.allocate(1)
    pool.cache(block, 5)
    pool.free([block])
    pool.allocate(1)  # evicted before anyone took the change
    update = sketch.take()
    assert update.added == () and update.removed == (5,)


def test_a_receiver_follows_diffs_and_needs_a_full_set_after_a_gap():
    sketch = PrefixSketch()
    receiver = HeldBlocks()
    sketch.added(1)
    assert not receiver.apply(sketch.take())  # a diff, but it holds nothing yet
    assert receiver.apply(sketch.take(full=True))
    assert receiver.hashes == {1}
    sketch.added(2)
    sketch.removed(1)
    assert receiver.apply(sketch.take())
    assert receiver.hashes == {2} and receiver.version == sketch.version
    sketch.added(3)
    sketch.take()  # lost on the way
    sketch.added(4)
    assert not receiver.apply(sketch.take())  # from a base it never saw: refused, unchanged
    assert receiver.hashes == {2}
    assert receiver.apply(sketch.take(full=True))
    assert receiver.hashes == {2, 3, 4}


def test_a_restarted_replica_starts_a_new_history():
    old, new = PrefixSketch(), PrefixSketch()
    receiver = HeldBlocks()
    old.added(1)
    receiver.apply(old.take(full=True))
    new.added(9)
    assert not receiver.apply(new.take())  # same versions, other epoch
    assert receiver.apply(new.take(full=True)) and receiver.hashes == {9}


def test_reset_prefix_cache_clears_the_sketch():
    sketch = PrefixSketch()
    pool = cached_pool(sketch)
    (block,) = pool.allocate(1)
    pool.cache(block, 42)
    pool.free([block])
    sketch.take()
    assert pool.reset_prefix_cache()
    update = sketch.take()
    assert update.removed == (42,) and len(sketch) == 0
