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

The returned views alias the buffers: they are valid until the next `fill`, which the runner
calls only after the previous step's forward has finished (its logits were read back).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

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


@dataclass(slots=True)
class StepTensors:
    """One step's model inputs: views of the persistent buffers (valid until the next fill)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    sample_rows: torch.Tensor  # [num_sampling_chunks] int64: packed rows whose logits are kept
    meta: AttentionMetadata


class _Buffer:
    """A device tensor with its host staging twin and a numpy view of the host side."""

    __slots__ = ("device", "host", "np")

    def __init__(self, shape: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.device = (
            self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        )

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
        return StepTensors(
            self._input_ids.view(num_tokens),
            self._positions.view(num_tokens),
            self._sample_rows.view(num_samples),
            meta,
        )
