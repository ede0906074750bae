"""Which model replica a request goes to.

A policy ranks the live replicas for one request: the first rank is tried first (Serve's
router then probes those replicas and takes the least loaded that accepts), the next rank
when every replica in the first is full, and so on. It runs inside every caller of the
ModelReplica deployment (the ingress), once per request, so it must be cheap and must not
block. Queue lengths are what Serve's router last heard from each replica (None: unknown).

`prefix_affinity` sends a prompt to the replica whose prefix cache holds the longest run of
its leading KV blocks (what replicas report holding, `policies/prefix_index.py`), so a shared
system prompt or a conversation's history is computed once and then read from that
replica's cache: prefill shrinks to the new tokens, which is what TTFT is made of. It gives
up the affinity when that replica's queue is longer than the shortest by more than
`max_imbalance` requests, so one hot prefix cannot pile every request onto one replica. The
block hashes are the engine's own (`engine.kv.block_hash`), chained, so a match on block i
means the whole prefix up to i matched.

`least_loaded` ranks by queue length only (ties broken at random); `round_robin` takes the
replicas in turn (the baseline); `class_pools` (policies/class_pools.py) keeps a pool of
replicas for interactive requests and ranks within each pool by another policy.

`actors/request_router.py` adapts a policy to Serve's `RequestRouter` (this module stays
Ray-free).
"""

from __future__ import annotations

import random
import time
from abc import abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv.block_hash import hash_prefix_blocks
from engine.request import Request
from policies.base import Policy, register
from policies.prefix_index import PrefixIndex


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

    def use_index(self, index: PrefixIndex) -> None:
        """What every replica's prefix cache holds, kept current by the caller (policies
        that route by it keep a reference; others ignore it)."""


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


@register("round_robin")
class RoundRobin(ReplicaRoutingPolicy):
    """Each request to the next replica in turn (ids in sorted order), whatever it holds or
    queues: the baseline the other policies are measured against. Serve still probes the
    chosen replica and moves on to the next rank when it is full."""

    def __init__(self) -> None:
        self._next = 0

    def rank(self, request: Request | None, replicas: Sequence[Candidate]) -> list[list[str]]:
        ids = sorted(r.replica_id for r in replicas)
        if not ids:
            return []
        start = self._next % len(ids)
        self._next += 1
        return [[rid] for rid in ids[start:] + ids[:start]]


@register("prefix_affinity")
class PrefixAffinity(ReplicaRoutingPolicy):
    """Sends a prompt to the replica holding the longest run of its leading KV blocks.

    What replicas hold comes from the `PrefixIndex` (`use_index`): the block hashes each
    replica's prefix cache reports, evictions included. Between a routing decision and the
    report that shows its blocks cached (a report period or two), a short-lived map of where
    this router sent each block (`recent_s`) bridges the gap, so a burst sharing a new prefix
    does not scatter before the first report. Without an index (no control plane) that map is
    all there is, kept LRU-bounded at `max_blocks` with no expiry.

    A prompt with no held prefix goes to the least loaded replica, ties broken towards the
    one holding the fewest blocks (held + recently sent): new prefixes spread evenly over the
    replicas' caches instead of by chance (a chance split of 12 prefixes over two pools that
    hold 7 each thrashes one of them about a third of the time). The affinity gives way to
    load when the holder's queue is longer than the shortest by more than `max_imbalance`."""

    def __init__(
        self,
        block_size: int = 16,
        max_prefix_blocks: int = 256,
        max_blocks: int = 200_000,
        max_imbalance: int = 8,
        recent_s: float = 5.0,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0 or max_prefix_blocks <= 0 or max_blocks <= 0 or max_imbalance < 0:
            raise ValueError("prefix_affinity: sizes must be positive, max_imbalance >= 0")
        if recent_s <= 0:
            raise ValueError("prefix_affinity: recent_s must be positive")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_blocks = max_blocks
        self.max_imbalance = max_imbalance
        self.recent_s = recent_s
        self.index: PrefixIndex | None = None
        self._clock = clock
        # block hash → (replica id, when sent); LRU order, oldest first
        self._sent: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._owned: Counter[str] = Counter()  # replica id → blocks it owns in `_sent`
        self._rng = random.Random(seed)
        self._last: tuple[str, list[int]] = ("", [])  # the hashes of the request last ranked

    def use_index(self, index: PrefixIndex) -> None:
        self.index = index

    def _hashes(self, request: Request) -> list[int]:
        if self.index is not None:
            return self.index.prompt_hashes(
                request.request_id, request.prompt_token_ids, self.max_prefix_blocks
            )
        rid, hashes = self._last
        if rid != request.request_id:
            limit = self.block_size * self.max_prefix_blocks
            hashes = hash_prefix_blocks(request.prompt_token_ids[:limit], self.block_size, 0)
            self._last = (request.request_id, hashes)
        return hashes

    def depths(self, request: Request, live: set[str]) -> dict[str, int]:
        """Per live replica, the run of the prompt's leading blocks it holds or was recently
        sent."""
        hashes = self._hashes(request)
        depths = (
            self.index.depths(hashes, live) if self.index is not None else dict.fromkeys(live, 0)
        )
        oldest = self._clock() - self.recent_s if self.index is not None else float("-inf")
        for i, block in enumerate(hashes):
            sent = self._sent.get(block)
            if sent is None or sent[0] not in live or sent[1] < oldest:
                break
            depths[sent[0]] = max(depths[sent[0]], i + 1)
        return depths

    def match(self, request: Request, live: set[str]) -> tuple[str | None, int]:
        """The live replica holding the longest run of the prompt's leading blocks, and how
        many blocks that is ((None, 0) when none)."""
        depths = self.depths(request, live)
        best = max(depths, key=lambda rid: depths[rid], default=None)
        if best is None or depths[best] == 0:
            return None, 0
        return best, depths[best]

    def rank(self, request: Request | None, replicas: Sequence[Candidate]) -> list[list[str]]:
        by_load = _by_load(replicas, self._rng)
        if request is None or not by_load:
            return _load_ranks(by_load)
        queues = {r.replica_id: r.queue_len or 0 for r in replicas}
        depths = self.depths(request, set(queues))
        deepest = max(depths.values())
        if deepest > 0:  # the deepest holder, the least loaded of those that tie
            best = min(
                (rid for rid in by_load if depths[rid] == deepest), key=lambda rid: queues[rid]
            )
        else:  # a new prefix: the least loaded, then the emptiest cache
            best = min(by_load, key=lambda rid: (queues[rid], self._blocks(rid)))
        if queues[best] - min(queues.values()) <= self.max_imbalance:
            return [[best], *_load_ranks([rid for rid in by_load if rid != best])]
        return _load_ranks(by_load)

    def _blocks(self, replica_id: str) -> int:
        held = self.index.num_blocks(replica_id) if self.index is not None else 0
        return held + self._owned[replica_id]

    def routed(self, request: Request | None, replica_id: str) -> None:
        if request is None:
            return
        sent, owned, now = self._sent, self._owned, self._clock()
        for block in self._hashes(request):
            previous = sent.get(block)
            if previous is None or previous[0] != replica_id:
                if previous is not None:
                    owned[previous[0]] -= 1
                owned[replica_id] += 1
            sent[block] = (replica_id, now)
            sent.move_to_end(block)
        oldest = now - self.recent_s if self.index is not None else float("-inf")
        while sent and (len(sent) > self.max_blocks or next(iter(sent.values()))[1] < oldest):
            _, (evicted, _) = sent.popitem(last=False)
            owned[evicted] -= 1

    def forget(self, live_replica_ids: set[str]) -> None:
        stale = [block for block, (rid, _) in self._sent.items() if rid not in live_replica_ids]
        for block in stale:
            del self._sent[block]
        for rid in [rid for rid in self._owned if rid not in live_replica_ids]:
            del self._owned[rid]


# The family's other policies, registered on import of this module.
import policies.class_pools  # noqa: E402, F401
