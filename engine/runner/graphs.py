"""CUDA graphs of decode steps: a whole forward pass replayed as one launch.

A decode step of a small model is all launch overhead: ~15 kernels per layer, each a few
microseconds of GPU work behind ~5 us of Python and driver time. At warm-up `DecodeGraphs`
captures, for each batch-size bucket and key-length bound, the model's forward over static
inputs: the runner's persistent `input_ids` / `positions` buffers
(`StepBuffers.device_inputs`) and the attention backend's static metadata
(`prepare_for_capture`, see `kernels.graph_metadata`). The KV caches never move, so the
graph writes and reads them in place.

A live step runs from a graph when every chunk has exactly one query token (decodes, and a
prefill's one-token last chunk) and it has at most the largest bucket's sequences. Then:
`StepBuffers.fill` copies its lists to the device as for any step, `prepare_for_replay` copies
its metadata into the static buffers of the smallest bucket that holds it (padding sequences
read no key and write no slot), the graph replays, and the first `n` rows of its output are
the hidden states. The logits head runs outside the graph, on the sampling rows only.

Buckets: batch sizes 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, ... (each at most
1.5x the last, so padding wastes at most a third of a step's rows, and padded rows attend to
nothing) up to the step limits; key-length bounds 512 x 4^i up to `max_model_len`. A kernel
plans its launch for the bound it was captured with (Triton's split-KV count grows with it),
so a short context replays a graph planned for short contexts.

All graphs share one memory pool and are captured largest first, so the pool holds the
largest bucket's activations once. Without CUDA (`capture=False`: tests on the CPU) a "graph"
is the same forward called on the same static buffers: every part of the path but the
capture itself.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.models.llama import LlamaForCausalLM
from engine.runner.inputs import StepBuffers
from kernels.interface import AttentionBackend, AttentionMetadata, KVCache

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)

MIN_SEQLEN_BOUND = 512


def batch_buckets(limit: int) -> list[int]:
    """1, 2, 4, 8, then powers of two and 1.5x powers of two (16, 24, 32, 48, ...) below
    `limit`, then `limit`."""
    sizes = {1 << k for k in range(limit.bit_length())} | {
        3 << k for k in range(3, limit.bit_length())
    }
    return [*sorted(s for s in sizes if s < limit), limit]


def seqlen_bounds(max_model_len: int, smallest: int = MIN_SEQLEN_BOUND) -> list[int]:
    """`smallest` x 4^i below `max_model_len`, then `max_model_len`."""
    bounds = []
    bound = smallest
    while bound < max_model_len:
        bounds.append(bound)
        bound *= 4
    return [*bounds, max_model_len]


class DecodeGraph:
    """One captured forward: bucket `bs`, planned for keys up to `max_seqlen_k`."""

    __slots__ = ("_forward", "_graph", "_output", "bs", "max_seqlen_k", "meta")

    def __init__(
        self,
        bs: int,
        max_seqlen_k: int,
        meta: AttentionMetadata,
        forward: Callable[[], torch.Tensor],
        graph: torch.cuda.CUDAGraph | None,
        output: torch.Tensor | None,
    ):
        self.bs = bs
        self.max_seqlen_k = max_seqlen_k
        self.meta = meta  # keeps the captured metadata (and the backend's state) alive
        self._forward = forward
        self._graph = graph
        self._output = output

    def replay(self) -> torch.Tensor:
        """`[bs, hidden]`: the graph's output buffer (overwritten by the next replay)."""
        if self._graph is None:
            return self._forward()
        self._graph.replay()
        assert self._output is not None
        return self._output


class DecodeGraphs:
    """The decode graphs of one model runner (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        buffers: StepBuffers,
        *,
        max_batch: int,
        max_model_len: int,
        dtype: torch.dtype,
        capture: bool = True,
        min_seqlen_bound: int = MIN_SEQLEN_BOUND,
    ):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.batch_sizes = batch_buckets(max_batch)
        self.seqlen_bounds = seqlen_bounds(max_model_len, min_seqlen_bound)  # ends at the max
        self.dtype = dtype
        self.capture = capture
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (batch size, key bound) graph, largest first, into one pool."""
        start = time.perf_counter()
        device = self.buffers.device
        block_size = self.buffers.block_size
        max_model_len = self.seqlen_bounds[-1]
        self.backend.init_capture(
            self.batch_sizes[-1], -(-max_model_len // block_size), device, block_size
        )
        self.model.rotary.reserve(max_model_len, self.dtype)
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for bs in reversed(self.batch_sizes):
            for bound in reversed(self.seqlen_bounds):
                self.graphs[bs, bound] = self._capture(bs, bound, pool)
        if self.capture:
            torch.cuda.synchronize(device)
        log.info(
            "captured %d decode graphs (batch sizes %s; key bounds %s) in %.1f s",
            len(self.graphs), self.batch_sizes, self.seqlen_bounds, time.perf_counter() - start,
        )  # fmt: skip

    def _capture(self, bs: int, bound: int, pool: _POOL_HANDLE | None) -> DecodeGraph:
        meta = self.backend.prepare_for_capture(bs, bound)
        input_ids, positions = self.buffers.device_inputs(bs)
        model, kv_caches = self.model, self.kv_caches  # not `self`: no reference cycle keeps
        # the graphs, and with them the KV cache, alive after the engine is dropped

        def forward() -> torch.Tensor:
            return model(input_ids, positions, kv_caches, meta)

        if not self.capture:
            return DecodeGraph(bs, bound, meta, forward, None, None)
        # Run once outside the capture: kernels compile and plan for this shape (padding rows
        # only: no key read, no slot written), so the capture records launches alone.
        forward()
        torch.cuda.synchronize(self.buffers.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
        return DecodeGraph(bs, bound, meta, forward, graph, output)

    def lookup(self, meta: AttentionMetadata) -> DecodeGraph | None:
        """The graph that runs this step, or None when the step is not a decode batch that a
        captured bucket holds."""
        n, keys = meta.num_seqs, meta.max_seqlen_k
        sizes, bounds = self.batch_sizes, self.seqlen_bounds
        if meta.max_seqlen_q != 1 or meta.num_tokens != n or n > sizes[-1] or keys > bounds[-1]:
            return None
        return self.graphs[
            sizes[bisect.bisect_left(sizes, n)], bounds[bisect.bisect_left(bounds, keys)]
        ]

    def run(self, graph: DecodeGraph, meta: AttentionMetadata) -> torch.Tensor:
        """`[n, hidden]` hidden states of the live step `meta` (a view of the graph's output,
        valid until the next replay)."""
        self.backend.prepare_for_replay(graph.bs, meta)
        self.num_replays += 1
        return graph.replay()[: meta.num_seqs]
