"""What a replica's prefix cache holds, published as versioned diffs for routing.

Routing a prompt to the replica that already holds its leading KV blocks turns its prefill
into a cache read (TTFT). The router needs to know what each replica *holds*, not what it
was sent: blocks are evicted under memory pressure, and a replica restarted or scaled in
holds nothing. The block pool tells a `PrefixSketch` every block hash it starts and stops
caching (engine thread); a reporter takes the net change since its last take as a
`SketchUpdate` (any thread) and ships it to the control plane, which fans it out to every
router (actors/prefix_index.py).

Protocol, per replica: updates carry `(epoch, base, version)`; a receiver holding exactly
`(epoch, base)` applies the diff, anyone else needs a full update (`full=True`: `added` is the
whole set). `take(full=True)` is what a reporter sends first and after any failed or refused
report, so a lost report costs one full set, never a wrong view. `epoch` is fresh per
sketch (a restarted replica never continues an old history).

Hashes are the engine's chained block hashes (engine/kv/block_hash.py) under `extra_key`, so
a router that hashes a prompt's full blocks with the same key finds its longest held prefix.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SketchUpdate:
    """The change of one replica's cached block set from version `base` to `version`."""

    epoch: int
    base: int  # the version this diff applies to (ignored when `full`)
    version: int
    added: tuple[int, ...]
    removed: tuple[int, ...] = ()
    full: bool = False
    extra_key: int = 0  # the block-hash key the hashes were computed with
    block_size: int = 16

    @property
    def empty(self) -> bool:
        return not self.full and not self.added and not self.removed


class PrefixSketch:
    """The set of block hashes a pool holds, plus the net change since the last `take`.

    `added`/`removed` are called by the block pool on the engine thread; `take` from any
    thread. A lock makes each call atomic (uncontended: one pool event per block cached or
    evicted, one take per report)."""

    def __init__(self, extra_key: int = 0, block_size: int = 16) -> None:
        self.extra_key = extra_key
        self.block_size = block_size
        self.epoch = secrets.randbits(63)
        self.version = 0
        self._held: set[int] = set()
        self._changes: dict[int, bool] = {}  # hash → held now (net since the last take)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def added(self, block_hash: int) -> None:
        with self._lock:
            self._held.add(block_hash)
            self._changes[block_hash] = True

    def removed(self, block_hash: int) -> None:
        with self._lock:
            self._held.discard(block_hash)
            self._changes[block_hash] = False

    def cleared(self) -> None:
        with self._lock:
            for block_hash in self._held:
                self._changes[block_hash] = False
            self._held.clear()

    def take(self, full: bool = False) -> SketchUpdate:
        """The change since the last take (a new version when anything changed), or the whole
        set at the current version when `full`."""
        with self._lock:
            base = self.version
            changes, self._changes = self._changes, {}
            # A hash added and removed again since the last take nets out in `_changes`; one
            # removed and re-added may be reported as added although the receiver holds it.
            added = tuple(h for h, held in changes.items() if held)
            removed = tuple(h for h, held in changes.items() if not held)
            if added or removed:
                self.version += 1
            if full:
                return SketchUpdate(
                    self.epoch,
                    base,
                    self.version,
                    tuple(self._held),
                    full=True,
                    extra_key=self.extra_key,
                    block_size=self.block_size,
                )
            return SketchUpdate(
                self.epoch,
                base,
                self.version,
                added,
                removed,
                extra_key=self.extra_key,
                block_size=self.block_size,
            )


class HeldBlocks:
    """A receiver's copy of one replica's sketch: the set at (`epoch`, `version`)."""

    __slots__ = ("block_size", "epoch", "extra_key", "hashes", "version")

    def __init__(self) -> None:
        self.epoch = -1  # nothing received yet
        self.version = -1
        self.hashes: set[int] = set()
        self.extra_key = 0
        self.block_size = 16

    def apply(self, update: SketchUpdate) -> bool:
        """Apply `update`; False (and unchanged) when it is a diff from another base."""
        if update.full:
            self.hashes = set(update.added)
        elif update.epoch != self.epoch or update.base != self.version:
            return False
        else:
            self.hashes.difference_update(update.removed)
            self.hashes.update(update.added)
        self.epoch, self.version = update.epoch, update.version
        self.extra_key, self.block_size = update.extra_key, update.block_size
        return True

    def as_full(self) -> SketchUpdate:
        return SketchUpdate(
            self.epoch,
            self.version,
            self.version,
            tuple(self.hashes),
            full=True,
            extra_key=self.extra_key,
            block_size=self.block_size,
        )
