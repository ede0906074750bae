"""Persistent step input buffers: one step's packed host lists into preallocated tensors.

`StepBuffers` is allocated once per runner, sized by the scheduler's limits, and each step
`fill` writes `StepInputs` (plain lists, built by `ModelRunner.pack`) into it and
returns views plus the step's `AttentionMetadata`. Nothing is allocated per step apart from
the views themselves; this is also what CUDA graphs need (static input addresses).

The lists are written through numpy views of the host buffers: numpy converts a list of
Python ints straight into the buffer, 3-4x cheaper than `torch.tensor(list)` (which builds a
new tensor) and far cheaper than copying such a tensor into a slice. On a GPU device the host
buffers are pinned and each filled prefix goes to its device buffer with one non-blocking
copy; on the CPU the host buffers are the device buffers.

The returned views alias the buffers: they are valid until the next `fill`. On a GPU the
host side alternates between two staging copies, and `fill` waits (an event) for the copies
out of the one it is about to rewrite, from two steps back, to have run: a non-blocking copy
reads its pinned source when the device's queue reaches it, which may be after the host has
moved on (a step that samples nothing is never waited for; a step launched ahead, never
before the next is prepared). Device buffers are rewritten by copies queued behind the
kernels that read them, so the queue's order protects them.

Feed rows (`StepInputs.feed_dst` / `feed_src`): input positions whose token the host does
not know yet (the previous step's sampled token, still on the device); the runner writes them
from that step's token tensor after `fill` (`StepTensors.feed`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from kernels.interface import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    """One step's packed inputs as plain lists (built without touching torch)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    seq_lens_k: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # packed rows of each sampling chunk's last real token and drafts
    # Packed rows whose input token is the previous step's sampled token at row `feed_src`.
    feed_dst: list[int] = field(default_factory=list)
    feed_src: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepTensors:
    """One step's model inputs: views of the persistent buffers (valid until the next fill)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    sample_rows: torch.Tensor  # [num_sampling_chunks] int64: packed rows whose logits are kept
    meta: AttentionMetadata
    feed: tuple[torch.Tensor, torch.Tensor] | None = None  # (dst rows, src rows), int64


class _Buffer:
    """A device tensor with its host staging twins (two on a GPU, taken in turn; the device
    tensor itself on the CPU) and numpy views of the host side."""

    __slots__ = ("device", "host", "hosts", "np", "nps")

    def __init__(self, shape: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        copies = 1 if device.type == "cpu" else 2
        self.hosts = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(copies)]
        self.nps = [h.numpy() for h in self.hosts]
        self.host, self.np = self.hosts[0], self.nps[0]
        self.device = (
            self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        )

    def turn(self, i: int) -> None:
        """Stage through host copy `i` (of two) from now on."""
        self.host, self.np = self.hosts[i], self.nps[i]

    def view(self, n: int) -> torch.Tensor:
        """The first `n` elements on the device (copied there from the host when separate)."""
        if self.device is self.host:
            return self.host[:n]
        return self.device[:n].copy_(self.host[:n], non_blocking=True)


class StepBuffers:
    """Preallocated input tensors for steps of up to `max_num_tokens` tokens over up to
    `max_num_seqs` sequences of up to `max_blocks_per_seq` blocks each.

    `fill(step)` raises ValueError when a step exceeds those limits (a scheduler bug: the
    buffers never grow). Block-table rows are padded with block 0 up to the step's widest row,
    as the attention contract requires, so no id from an earlier step leaks into the padding.
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ):
        if min(max_num_tokens, max_num_seqs, max_blocks_per_seq, block_size) < 1:
            raise ValueError("StepBuffers limits and block_size must be at least 1")
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        dev = self.device
        self._input_ids = _Buffer(max_num_tokens, torch.int64, dev)
        self._positions = _Buffer(max_num_tokens, torch.int64, dev)
        self._slot_mapping = _Buffer(max_num_tokens, torch.int64, dev)
        self._sample_rows = _Buffer(max_num_tokens, torch.int64, dev)  # speculative rows too
        self._cu_seqlens_q = _Buffer(max_num_seqs + 1, torch.int32, dev)
        self._seq_lens_k = _Buffer(max_num_seqs, torch.int32, dev)
        # Flat, so that a step's [B, width] table is one contiguous prefix.
        self._block_table = _Buffer(max_num_seqs * max_blocks_per_seq, torch.int32, dev)
        self._feed_dst = _Buffer(max_num_seqs, torch.int64, dev)
        self._feed_src = _Buffer(max_num_seqs, torch.int64, dev)
        self._all = [
            self._input_ids, self._positions, self._slot_mapping, self._sample_rows,
            self._cu_seqlens_q, self._seq_lens_k, self._block_table, self._feed_dst,
            self._feed_src,
        ]  # fmt: skip
        # Staging copy in use, and per copy the event after the copies that last read it
        # (an event never recorded is waited on as done).
        self._turn = 0
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if dev.type == "cuda" else []

    def device_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` entries of the device `input_ids` and `positions` buffers, at fixed
        addresses (what a CUDA graph reads). Past the last step's own tokens they hold earlier
        steps' values or zeros: valid token ids and positions, never garbage."""
        return self._input_ids.device[:n], self._positions.device[:n]

    def fill(self, step: StepInputs) -> StepTensors:
        """Write `step` into the buffers; the views and metadata of exactly `step`'s sizes."""
        num_tokens = len(step.input_ids)
        num_seqs = len(step.seq_lens_k)
        tables = step.block_tables
        width = max(map(len, tables))
        if num_tokens > self.max_num_tokens or num_seqs > self.max_num_seqs:
            raise ValueError(
                f"step of {num_tokens} tokens over {num_seqs} sequences exceeds the buffers "
                f"({self.max_num_tokens} tokens, {self.max_num_seqs} sequences)"
            )
        if width > self.max_blocks_per_seq:
            raise ValueError(
                f"a block table of {width} blocks exceeds the buffers' {self.max_blocks_per_seq}"
            )
        self._next_staging()
        self._input_ids.np[:num_tokens] = step.input_ids
        self._positions.np[:num_tokens] = step.positions
        self._slot_mapping.np[:num_tokens] = step.slot_mapping
        self._cu_seqlens_q.np[: num_seqs + 1] = step.cu_seqlens_q
        self._seq_lens_k.np[:num_seqs] = step.seq_lens_k
        num_samples = len(step.sample_rows)
        self._sample_rows.np[:num_samples] = step.sample_rows
        # One flat list padded with block 0, written in one go (half the cost of row by row).
        flat: list[int] = []
        zeros = [0] * width
        for blocks in tables:
            flat += blocks
            flat += zeros[len(blocks) :]
        self._block_table.np[: num_seqs * width] = flat
        cu = step.cu_seqlens_q
        meta = AttentionMetadata(
            cu_seqlens_q=self._cu_seqlens_q.view(num_seqs + 1),
            seq_lens_k=self._seq_lens_k.view(num_seqs),
            block_table=self._block_table.view(num_seqs * width).view(num_seqs, width),
            slot_mapping=self._slot_mapping.view(num_tokens),
            max_seqlen_q=max(map(operator.sub, cu[1:], cu)),
            max_seqlen_k=max(step.seq_lens_k),
            block_size=self.block_size,
        )
        feed = None
        if num_feed := len(step.feed_dst):
            self._feed_dst.np[:num_feed] = step.feed_dst
            self._feed_src.np[:num_feed] = step.feed_src
            feed = (self._feed_dst.view(num_feed), self._feed_src.view(num_feed))
        tensors = StepTensors(
            self._input_ids.view(num_tokens),
            self._positions.view(num_tokens),
            self._sample_rows.view(num_samples),
            meta,
            feed,
        )
        if self._copied:
            self._copied[self._turn].record()
        return tensors

    def _next_staging(self) -> None:
        """Take the other host staging copy (GPU), once the copies that read it have run."""
        if not self._copied:
            return
        self._turn ^= 1
        self._copied[self._turn].synchronize()  # two steps back: almost always long done
        for buffer in self._all:
            buffer.turn(self._turn)
