"""Per-sequence view of the KV block pool: prefix-cache lookups, slot allocation, caching.

A sequence's `block_ids` cover positions `[0, len(block_ids) * block_size)`; block `i` holds
positions `[i * block_size, (i + 1) * block_size)`. Its life with the scheduler:

    get_computed_blocks(seq)        on (re)admission: reference the longest cached prefix
    allocate_slots(seq, n)          before each step: cover num_computed_tokens + n positions
    rollback(seq)                   after a step with drafts: drop blocks past the computed
                                    positions (they hold only rejected drafts)
    cache_full_blocks(seq)          after each step: name the blocks that became full
    free(seq)                       on finish, abort or preemption: drop the references

    | cached (hit) | computed, full → cached | computed | new chunk (n) | unallocated |
    0        num_cached          num_computed // bs     num_computed     num_computed + n

Freed blocks keep their hashes until reused, so a preempted or repeated prompt hits them
later. The per-sequence hash chain grows incrementally: each full block is hashed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.block_hash import hash_block
from engine.kv.block_pool import BlockPool
from engine.kv.sketch import PrefixSketch
from engine.sequence import Sequence


@dataclass(slots=True)
class KVCacheStats:
    num_blocks: int
    num_free: int  # unreferenced blocks, evictable cached ones included
    usage: float  # fraction of blocks referenced
    prefix_queries: int  # tokens looked up in the prefix cache on admission
    prefix_hits: int  # of those, tokens found cached
    num_cached_blocks: int = 0


@dataclass(slots=True)
class _SeqCacheState:
    hashes: list[int] = field(default_factory=list)  # chained hashes of leading full blocks
    num_cached: int = 0  # leading blocks of seq.block_ids already in the prefix cache


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_key: int = 0,
        sketch: PrefixSketch | None = None,
    ):
        self.pool = BlockPool(num_blocks, block_size, sketch)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._states: dict[str, _SeqCacheState] = {}
        # (queries, hits) of admissions whose allocation has not succeeded yet
        self._pending_stats: dict[str, tuple[int, int]] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free=self.pool.num_free_blocks,
            usage=self.pool.usage,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            num_cached_blocks=self.pool.num_cached_blocks,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many blocks `allocate_slots(seq, num_new_tokens)` would take from the pool."""
        covered = seq.num_computed_tokens + num_new_tokens
        return max(0, self.num_blocks_for(covered) - len(seq.block_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no sequence holds blocks."""
        return self.pool.reset_prefix_cache()

    # -- the sequence lifecycle ----------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> int:
        """Reference the longest cached prefix of `seq` and return its length in tokens.

        Sets `seq.block_ids` to the hit blocks (the sequence must hold none). At most
        `num_tokens - 1` tokens, rounded down to a block boundary, are served from the cache:
        the last token is always computed, since its logits give the next token. The query and
        hit counters move once `allocate_slots` succeeds, so a sequence that waits for room
        and retries is counted once.
        """
        assert not seq.block_ids, f"{seq.request_id} already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        state = self._states[seq.request_id] = _SeqCacheState()
        bs = self.block_size
        hit: list[int] = []
        for i in range((seq.num_tokens - 1) // bs):
            parent = state.hashes[-1] if state.hashes else None
            block_hash = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], self.extra_key)
            state.hashes.append(block_hash)
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        self.pool.touch(hit)
        seq.block_ids = hit
        state.num_cached = len(hit)
        self._pending_stats[seq.request_id] = (seq.num_tokens, len(hit) * bs)
        return len(hit) * bs

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq.block_ids` to cover `num_computed_tokens + num_new_tokens` positions.

        Returns False and allocates nothing when the free blocks (evictable cached ones
        included) are too few; evicting a cached block drops it from the prefix cache.
        """
        assert num_new_tokens >= 0
        need = self.num_new_blocks(seq, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        if self._pending_stats and seq.request_id in self._pending_stats:
            queries, hits = self._pending_stats.pop(seq.request_id)
            self.prefix_queries += queries
            self.prefix_hits += hits
        return True

    def cache_full_blocks(self, seq: Sequence, num_known: int | None = None) -> None:
        """Register the blocks of `seq` whose every position is computed (after a step), and
        with `num_known`, only those within the first `num_known` tokens (the tokens past it
        are not known yet: a step launched before its input token was read back)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        computed = seq.num_computed_tokens
        if num_known is not None:
            computed = min(computed, num_known)
        num_full = min(computed // bs, len(seq.block_ids))
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _SeqCacheState()
        elif num_full <= state.num_cached:
            return  # the common decode step: no block became full
        for i in range(state.num_cached, num_full):
            if i == len(state.hashes):
                parent = state.hashes[-1] if state.hashes else None
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                state.hashes.append(hash_block(parent, tokens, self.extra_key))
            self.pool.cache(seq.block_ids[i], state.hashes[i])
        state.num_cached = max(state.num_cached, num_full)

    def forget_prefix_cache(self) -> None:
        """Forget every cached prefix, the blocks sequences hold included (`reset_prefix_cache`
        needs none held): after a step that failed on the device, no block's contents can be
        trusted. Sequences that go on cache their full blocks again as they advance."""
        self.pool.forget_hashes()
        self._states.clear()

    def rollback(self, seq: Sequence) -> None:
        """Return the blocks of `seq` past `num_computed_tokens` to the pool, last first.

        After verification `num_computed_tokens` counts only positions whose K/V is valid, so
        the dropped blocks hold rejected drafts and nothing else; they were never cached (only
        blocks whose every position is computed are). A kept partial block may hold rejected
        K/V past `num_computed_tokens`: those slots are rewritten before anything reads them.
        """
        keep = self.num_blocks_for(seq.num_computed_tokens)
        if len(seq.block_ids) > keep:
            self.pool.free(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop the references of `seq`, last block first, and clear `seq.block_ids`.

        Cached blocks stay cached (evictable) until the pool reuses them; freeing the tail
        first makes a request's least shareable blocks the first to go.
        """
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        self._states.pop(seq.request_id, None)
        self._pending_stats.pop(seq.request_id, None)
