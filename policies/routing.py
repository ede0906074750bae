"""Which model replica a request goes to.

A policy ranks the live replicas for one request: the first rank is tried first (Serve's
router then probes those replicas and takes the least loaded that accepts), the next rank
when every replica in the first is full, and so on. It runs inside every caller of the
ModelReplica deployment (the ingress), once per request, so it must be cheap and must not
block. Queue lengths are what Serve's router last heard from each replica (None: unknown).

`prefix_affinity` (the default) sends a prompt to the replica that most recently received
the longest run of its leading KV blocks, so a shared system prompt or a conversation's
history is computed once and then read from that replica's prefix cache: prefill shrinks to
the new tokens, which is what TTFT is made of. It gives up the affinity when that replica's
queue is longer than the shortest by more than `max_imbalance` requests, so one hot prefix
cannot pile every request onto one replica. The block hashes are the engine's own
(`engine.kv.block_hash`), chained, so a match on block i means the whole prefix up to i matched.

`least_loaded` ranks by queue length only (ties broken at random).

`actors/request_router.py` adapts a policy to Serve's `RequestRouter` (this module stays
Ray-free).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv.block_hash import hash_prefix_blocks
from engine.request import Request
from policies.base import Policy, register


@dataclass(frozen=True, slots=True)
class Candidate:
    replica_id: str
    queue_len: int | None  # ongoing requests as last reported; None when unknown


class ReplicaRoutingPolicy(Policy, family=True):
    @abstractmethod
    def rank(self, request: Request | None, replicas: Sequence[Candidate]) -> list[list[str]]:
        """Replica ids in ranks, most preferred first (every replica at most once)."""

    def routed(self, request: Request | None, replica_id: str) -> None:
        """`request` was sent to `replica_id` (policies with memory learn here)."""

    def forget(self, live_replica_ids: set[str]) -> None:
        """Only these replicas exist now."""


def _by_load(replicas: Sequence[Candidate], rng: random.Random) -> list[str]:
    """Replica ids, shortest known queue first; unknown queues count as empty."""
    keyed = [(r.queue_len or 0, rng.random(), r.replica_id) for r in replicas]
    return [rid for _, _, rid in sorted(keyed)]


def _load_ranks(ids: list[str]) -> list[list[str]]:
    """The two least loaded first (Serve probes both and takes the shorter queue, so a
    stale queue length costs little), then the rest one by one."""
    return [ids[:2]] + [[rid] for rid in ids[2:]] if ids else []


@register("least_loaded")
class LeastLoaded(ReplicaRoutingPolicy):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, request: Request | None, replicas: Sequence[Candidate]) -> list[list[str]]:
        return _load_ranks(_by_load(replicas, self._rng))


@register("prefix_affinity")
class PrefixAffinity(ReplicaRoutingPolicy):
    """An approximate map from KV block hash to the replica that last received it (LRU,
    at most `max_blocks` entries), filled as requests are routed.

    A prompt with no known prefix goes to the least loaded replica, ties broken towards the
    one that holds the fewest blocks in the map: new prefixes spread evenly over the
    replicas' caches instead of by chance (a chance split of 12 prefixes over two pools that
    hold 7 each thrashes one of them about a third of the time)."""

    def __init__(
        self,
        block_size: int = 16,
        max_prefix_blocks: int = 256,
        max_blocks: int = 200_000,
        max_imbalance: int = 8,
        seed: int | None = None,
    ) -> None:
        if block_size <= 0 or max_prefix_blocks <= 0 or max_blocks <= 0 or max_imbalance < 0:
            raise ValueError("prefix_affinity: sizes must be positive, max_imbalance >= 0")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_blocks = max_blocks
        self.max_imbalance = max_imbalance
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash → replica id
        self._owned: Counter[str] = Counter()  # replica id → blocks it owns in `_owner`
        self._rng = random.Random(seed)
        self._last: tuple[str, list[int]] = ("", [])  # the hashes of the request last ranked

    def _hashes(self, request: Request) -> list[int]:
        rid, hashes = self._last
        if rid != request.request_id:
            limit = self.block_size * self.max_prefix_blocks
            hashes = hash_prefix_blocks(request.prompt_token_ids[:limit], self.block_size, 0)
            self._last = (request.request_id, hashes)
        return hashes

    def match(self, request: Request, live: set[str]) -> tuple[str | None, int]:
        """The live replica holding the longest run of the prompt's leading blocks, and how
        many blocks that is ((None, 0) when none)."""
        best: str | None = None
        depth = 0
        for i, block in enumerate(self._hashes(request)):
            owner = self._owner.get(block)
            if owner is None or owner not in live:
                break
            best, depth = owner, i + 1
        return best, depth

    def rank(self, request: Request | None, replicas: Sequence[Candidate]) -> list[list[str]]:
        by_load = _by_load(replicas, self._rng)
        if request is None or not by_load:
            return _load_ranks(by_load)
        best, _ = self.match(request, {r.replica_id for r in replicas})
        queues = {r.replica_id: r.queue_len or 0 for r in replicas}
        if best is None:  # a new prefix: the least loaded, then the emptiest cache
            best = min(by_load, key=lambda rid: (queues[rid], self._owned[rid]))
        if queues[best] - min(queues.values()) <= self.max_imbalance:
            return [[best], *_load_ranks([rid for rid in by_load if rid != best])]
        return _load_ranks(by_load)

    def routed(self, request: Request | None, replica_id: str) -> None:
        if request is None:
            return
        owner, owned = self._owner, self._owned
        for block in self._hashes(request):
            previous = owner.get(block)
            if previous != replica_id:
                if previous is not None:
                    owned[previous] -= 1
                owned[replica_id] += 1
            owner[block] = replica_id
            owner.move_to_end(block)
        while len(owner) > self.max_blocks:
            _, evicted = owner.popitem(last=False)
            owned[evicted] -= 1

    def forget(self, live_replica_ids: set[str]) -> None:
        stale = [block for block, rid in self._owner.items() if rid not in live_replica_ids]
        for block in stale:
            del self._owner[block]
        for rid in [rid for rid in self._owned if rid not in live_replica_ids]:
            del self._owned[rid]
