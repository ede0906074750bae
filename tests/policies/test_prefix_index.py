"""A router's copy of the replicas' sketches: follows diffs, forgets the gone, hashes as
the engine does."""

from __future__ import annotations

from engine.kv.block_hash import hash_prefix_blocks
from engine.kv.sketch import PrefixSketch
from policies.prefix_index import PrefixIndex


def test_it_follows_diffs_and_drops_a_replica_whose_diff_does_not_fit():
    sketch = PrefixSketch()
    index = PrefixIndex()
    sketch.added(1)
    index.apply({"a": sketch.take(full=True)}, live={"a"}, now=5.0)
    assert index.have() == {"a": (sketch.epoch, 1)} and index.synced_at == 5.0
    sketch.added(2)
    index.apply({"a": sketch.take()}, live={"a"})
    assert index.depths([1, 2, 3], ["a"]) == {"a": 2}
    sketch.added(3)
    sketch.take()  # never delivered
    sketch.added(4)
    index.apply({"a": sketch.take()}, live={"a"})
    assert "a" not in index  # the next sync asks for it whole
    index.apply({"a": sketch.take(full=True)}, live={"a"})
    assert index.depths([1, 2, 3, 4], ["a", "gone"]) == {"a": 4, "gone": 0}
    index.apply({}, live=set())
    assert index.have() == {}


def test_prompt_hashes_use_the_replicas_key_and_block_size():
    sketch = PrefixSketch(extra_key=1234, block_size=4)
    index = PrefixIndex()
    index.apply({"a": sketch.take(full=True)}, live={"a"})
    tokens = list(range(10))
    assert index.prompt_hashes("r", tokens, limit=8) == hash_prefix_blocks(tokens, 4, 1234)
    assert index.prompt_hashes("r", tokens, limit=1) == hash_prefix_blocks(tokens, 4, 1234)
    assert len(index.prompt_hashes("s", tokens, limit=1)) == 1  # a new request: the limit
