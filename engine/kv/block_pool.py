"""The paged KV block pool: reference counts, an LRU free queue, and the prefix-cache map.

Invariants:
* A block is in the free queue exactly when its ref count is 0. Free blocks may still hold
  a hash: they are *cached* and *evictable*. `num_free_blocks` counts them, since allocating
  one only costs the cache entry.
* The free queue is in eviction order: allocation pops from the front; a freed block that
  holds a hash is appended at the back (least recently used is evicted first); a freed block
  without a hash holds nothing reusable, so it goes to the front and is reused first.
* `lookup(h)` finds a cached block whether it is in use or free; `touch` takes a reference
  and, for a free block, removes it from the free queue.
* Allocating a free block that holds a hash evicts it: its hash leaves the map.

The pool knows nothing about sequences; `KVCacheManager` decides what to free and in which
order (a request's blocks are freed last block first, so its tail is evicted first). A
`PrefixSketch`, when given, hears every hash that enters or leaves the map (for routing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv.sketch import PrefixSketch


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, sketch: PrefixSketch | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.sketch = sketch
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered block ids, front = next to evict. OrderedDict gives O(1) removal from the
        # middle when a cached free block gets hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    # -- counters ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_queue(self) -> list[int]:
        """The free block ids in eviction order (a copy, for tests and debugging)."""
        return list(self._free)

    # -- prefix cache ------------------------------------------------------------------------

    def lookup(self, block_hash: int) -> int | None:
        """The id of the block cached under `block_hash`, or None. Takes no reference."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Register a full, referenced block under `block_hash`.

        Returns False (and leaves the block uncached) when another block already holds that
        hash, which happens when two sequences computed the same prefix concurrently; the
        duplicate simply returns to the pool when freed.
        """
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"caching unreferenced block {block_id}"
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        if self.sketch is not None:
            self.sketch.added(block_hash)
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, e.g. after new weights. Only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.sketch is not None:
            self.sketch.cleared()
        return True

    def forget_hashes(self) -> None:
        """Drop every hash, blocks in use included: what they hold can no longer be trusted
        (a step that wrote into them failed on the device). The blocks stay where they are."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.sketch is not None:
            self.sketch.cleared()

    # -- references --------------------------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each block (cache hits); free ones leave the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.sketch is not None:
                    self.sketch.removed(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        Among cached blocks freed here, the first freed is evicted first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
