"""Typed engine stats: what the engine reports to the replica, the control plane and `/metrics`.

Plain frozen dataclasses (picklable, cheap to ship every ~0.5 s): a renamed field fails a type
check or a test instead of silently reading 0 the way a string-keyed dict did.

`EngineStats.spec` is None for an engine that does not speculate (no spec-decode families
are rendered for it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from engine.request import RequestClass

MAX_SPEC_TOKENS = 8  # the most drafts one sequence carries into a step


@dataclass(slots=True)
class EngineCounters:
    """What one engine counted since it started (engine thread only; `EngineStats` and
    `SpecStats` are built from it)."""

    steps: int = 0
    interrupted_steps: int = 0  # bulk-only steps stopped midway for an interactive arrival
    launched_steps: int = 0  # of `steps`, launched before the previous one landed (async)
    spare_rows: int = 0  # launched rows of sequences that had ended by then (ignored)
    generated_tokens: int = 0
    aborted: int = 0
    failed: int = 0  # requests ended with finish reason "error"
    num_drafts: int = 0  # sequence-steps that carried drafts
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of those, kept by verification (before any stop cuts the run)
    # accepted_per_pos[j]: drafts accepted at position j (the j+1-th draft of a run)
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_SPEC_TOKENS)
    propose_seconds: float = 0.0  # wall time in the proposer
    verify_seconds: float = 0.0  # wall time of steps that verified drafts


@dataclass(slots=True, frozen=True)
class ClassCounts:
    """One number per request class."""

    interactive: int = 0
    bulk: int = 0

    @classmethod
    def from_mapping(cls, counts: Mapping[str, int]) -> ClassCounts:
        """From a {class value: count} map (e.g. `SchedulerStats.running`); absent reads 0."""
        return cls(
            interactive=int(counts.get(RequestClass.INTERACTIVE.value, 0)),
            bulk=int(counts.get(RequestClass.BULK.value, 0)),
        )

    def of(self, request_class: RequestClass) -> int:
        return self.interactive if request_class is RequestClass.INTERACTIVE else self.bulk

    def plus(self, request_class: RequestClass, n: int) -> ClassCounts:
        if request_class is RequestClass.INTERACTIVE:
            return ClassCounts(self.interactive + n, self.bulk)
        return ClassCounts(self.interactive, self.bulk + n)

    def __add__(self, other: ClassCounts) -> ClassCounts:
        return ClassCounts(self.interactive + other.interactive, self.bulk + other.bulk)

    @property
    def total(self) -> int:
        return self.interactive + self.bulk

    def items(self) -> Iterator[tuple[str, int]]:
        """(class value, count) pairs, interactive first: the `class` label of a metric."""
        yield RequestClass.INTERACTIVE.value, self.interactive
        yield RequestClass.BULK.value, self.bulk


@dataclass(slots=True, frozen=True)
class KVStats:
    """The paged KV pool. `usage` is the fraction of blocks referenced (1 = full)."""

    num_blocks: int
    num_free_blocks: int  # unreferenced blocks, evictable cached ones included
    usage: float
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of those, tokens found cached


@dataclass(slots=True, frozen=True)
class AdmissionStats:
    """An engine's admission bounds and measured drain rate: enough for another process (the
    ingress, from the cluster view) to apply the same rule as `engine.sched.admission`."""

    max_waiting: int
    interactive_reserve: int
    drain_rate_per_s: float | None  # finishes per second over the recent window; None: unknown
    max_running: int = 0  # seats (max_num_seqs): with max_waiting, what the engine can hold


@dataclass(slots=True, frozen=True)
class SpecStats:
    """Speculative decoding, cumulative (vLLM's `spec_decode_*` counters, plus timings)."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()  # [j]: drafts accepted at position j
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposer_up: int = 1  # engines whose proposer is reachable (a DraftReplica may be down)

    def __add__(self, other: SpecStats) -> SpecStats:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + (0,) * (width - len(self.accepted_per_pos))
        b = other.accepted_per_pos + (0,) * (width - len(other.accepted_per_pos))
        return SpecStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(x + y for x, y in zip(a, b, strict=True)),
            self.propose_seconds + other.propose_seconds,
            self.verify_seconds + other.verify_seconds,
            self.proposer_up + other.proposer_up,
        )


@dataclass(slots=True, frozen=True)
class EngineStats:
    """One engine at one moment. Counters (`num_*` past events, `generation_tokens`) are
    cumulative since the engine started; the rest are gauges."""

    model: str
    running: ClassCounts
    waiting: ClassCounts
    kv: KVStats
    admission: AdmissionStats
    num_preemptions: int = 0
    num_aborted: int = 0  # aborted in the engine (client left, deadline, stalled reader)
    num_steps: int = 0
    num_interrupted_steps: int = 0  # bulk-only steps stopped for an interactive arrival
    generation_tokens: int = 0
    num_cancelled: int = 0  # readers that left before the end
    num_reader_stalls: int = 0  # streams cut because their reader stalled
    # requests taken in, per class: a replica that served chat between two looks at its
    # stats shows it here, where the running/waiting gauges of one moment may miss it
    num_requests: ClassCounts = ClassCounts()
    spec: SpecStats | None = None  # None: the engine does not speculate
    # TTFT p95 in the engine (arrival to first token) over the last `TTFTWindow.window_s`;
    # None: no first token of that class in the window
    ttft_p95_interactive_s: float | None = None
    ttft_p95_bulk_s: float | None = None


def sum_engine_stats(model: str, parts: Iterable[EngineStats]) -> EngineStats:
    """Several engines (replicas of one model) as one: counts, blocks, bounds and drain rates
    add up; KV usage is the block-weighted mean. No parts: an empty engine of zero size."""
    parts = list(parts)
    blocks = sum(p.kv.num_blocks for p in parts)
    rates = [p.admission.drain_rate_per_s for p in parts if p.admission.drain_rate_per_s]
    specs = [p.spec for p in parts if p.spec is not None]
    return EngineStats(
        model=model,
        running=sum((p.running for p in parts), ClassCounts()),
        waiting=sum((p.waiting for p in parts), ClassCounts()),
        kv=KVStats(
            num_blocks=blocks,
            num_free_blocks=sum(p.kv.num_free_blocks for p in parts),
            usage=sum(p.kv.usage * p.kv.num_blocks for p in parts) / blocks if blocks else 0.0,
            prefix_cache_queries=sum(p.kv.prefix_cache_queries for p in parts),
            prefix_cache_hits=sum(p.kv.prefix_cache_hits for p in parts),
        ),
        admission=AdmissionStats(
            max_waiting=sum(p.admission.max_waiting for p in parts),
            interactive_reserve=sum(p.admission.interactive_reserve for p in parts),
            drain_rate_per_s=sum(rates) if rates else None,
            max_running=sum(p.admission.max_running for p in parts),
        ),
        num_preemptions=sum(p.num_preemptions for p in parts),
        num_aborted=sum(p.num_aborted for p in parts),
        num_steps=sum(p.num_steps for p in parts),
        num_interrupted_steps=sum(p.num_interrupted_steps for p in parts),
        generation_tokens=sum(p.generation_tokens for p in parts),
        num_cancelled=sum(p.num_cancelled for p in parts),
        num_reader_stalls=sum(p.num_reader_stalls for p in parts),
        num_requests=sum((p.num_requests for p in parts), ClassCounts()),
        spec=sum(specs[1:], specs[0]) if specs else None,
        ttft_p95_interactive_s=_worst(p.ttft_p95_interactive_s for p in parts),
        ttft_p95_bulk_s=_worst(p.ttft_p95_bulk_s for p in parts),
    )


def _worst(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


class TTFTWindow:
    """Recent times to first token per request class, for a p95 over the last `window_s`
    (at most `max_samples` per class). Written on the engine thread, read on the event loop:
    a lock keeps each call whole."""

    def __init__(
        self,
        window_s: float = 30.0,
        max_samples: int = 2048,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples = {c: deque[tuple[float, float]](maxlen=max_samples) for c in RequestClass}
        self._lock = threading.Lock()

    def observe(self, request_class: RequestClass, ttft_s: float) -> None:
        with self._lock:
            self._samples[request_class].append((self.clock(), ttft_s))

    def p95(self, request_class: RequestClass) -> float | None:
        oldest = self.clock() - self.window_s
        with self._lock:
            samples = self._samples[request_class]
            while samples and samples[0][0] < oldest:
                samples.popleft()
            values = sorted(v for _, v in samples)
        if not values:
            return None
        return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]
