"""A router's local copy of what every replica's prefix cache holds, and of its load.

Each replica's engine publishes its cached block hashes as versioned diffs
(`engine.kv.sketch`); the control plane keeps the latest set per replica and hands every
router the diffs it has not seen. Routing reads only this local copy (a set lookup per
prompt block), never the control plane, so a slow or restarting control plane costs
freshness, not latency.

With the sketches come the replicas' latest engine stats (`loads`), for policies that route
by request class (policies/class_pools.py).

Not thread-safe: one event loop updates and reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from engine.kv.block_hash import hash_prefix_blocks
from engine.kv.sketch import HeldBlocks, SketchUpdate
from engine.stats import EngineStats


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[str, HeldBlocks] = {}
        self.loads: dict[str, EngineStats] = {}  # replica id → its latest reported stats
        self.synced_at: float | None = None  # monotonic time of the last successful sync
        self._last: tuple[str, int, list[int]] = ("", 0, [])  # request id, key, its hashes

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._held

    def have(self) -> dict[str, tuple[int, int]]:
        """(epoch, version) per replica held: what a sync asks to be brought up to date."""
        return {rid: (h.epoch, h.version) for rid, h in self._held.items()}

    def apply(
        self,
        updates: Mapping[str, SketchUpdate],
        live: Iterable[str],
        now: float | None = None,
        loads: Mapping[str, EngineStats] | None = None,
    ) -> None:
        """Apply the control plane's `updates` (and `loads`, when given); replicas not in
        `live` are forgotten. A diff that does not fit (it never should: the control plane
        answers what `have()` asked) drops that replica, so the next sync brings it whole."""
        live = set(live)
        if loads is not None:
            self.loads = {rid: stats for rid, stats in loads.items() if rid in live}
        for rid in [rid for rid in self._held if rid not in live]:
            del self._held[rid]
        for rid, update in updates.items():
            if rid not in live:
                continue
            held = self._held.setdefault(rid, HeldBlocks())
            if not held.apply(update):
                del self._held[rid]
        if now is not None:
            self.synced_at = now

    def num_blocks(self, replica_id: str) -> int:
        held = self._held.get(replica_id)
        return len(held.hashes) if held is not None else 0

    def prompt_hashes(self, request_id: str, token_ids: Sequence[int], limit: int) -> list[int]:
        """The chained hashes of the prompt's leading full blocks (at most `limit` blocks),
        under the replicas' block-hash key (cached for the last request asked about)."""
        held = next(iter(self._held.values()), None)
        key = held.extra_key if held is not None else 0
        size = held.block_size if held is not None else 16
        rid, last_key, hashes = self._last
        if rid != request_id or last_key != key:
            hashes = hash_prefix_blocks(token_ids[: size * limit], size, key)
            self._last = (request_id, key, hashes)
        return hashes

    def depths(self, hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Per replica, how many of the leading `hashes` it holds in a row."""
        out: dict[str, int] = {}
        for rid in replica_ids:
            held = self._held.get(rid)
            depth = 0
            if held is not None:
                blocks = held.hashes
                for block in hashes:
                    if block not in blocks:
                        break
                    depth += 1
            out[rid] = depth
        return out
