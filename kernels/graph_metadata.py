"""Static decode metadata: the CUDA-graph hooks of a backend whose kernels read only tensors.

A backend whose launches depend on tensor shapes alone (never on values read back to the
host) captures a decode step by capturing its launches over fixed buffers, then replays them
after new values are copied in. `StaticDecodeMetadata` implements the three graph hooks of
`AttentionBackend` that way, for such a backend to derive from:

* `init_capture(max_bs, max_blocks_per_seq, device, block_size)` allocates, once, `cu_seqlens_q`
  (`0, 1, ..., max_bs`: a decode batch has one query per sequence, so it never changes),
  `seq_lens_k`, a `[max_bs, max_blocks_per_seq]` block table and `slot_mapping`.
* `prepare_for_capture(bs, max_seqlen_k)` returns metadata over the first `bs` rows of those
  buffers, every sequence of key length 0 and every slot -1, so a warm-up or captured forward
  reads no key and writes nothing. `max_seqlen_k` is the bound the capture plans for: the
  kernels must treat `max_seqlen_q` / `max_seqlen_k` as upper bounds, not exact maxima (a
  replayed step's lengths are smaller), and the runner keeps a graph per bound it uses.
* `prepare_for_replay(bs, meta)` copies a live step's `n <= bs` lengths, block-table rows and
  slots in (device to device, no host read) and marks rows `n..bs` as padding: key length 0,
  slot -1 ("write nothing", which the backend's K/V write must honour). Block-table entries a
  row does not use keep earlier values, all valid block ids, and are never read.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kernels.interface import AttentionBackend, AttentionMetadata, StateT


class StaticDecodeMetadata(AttentionBackend[StateT]):
    """An `AttentionBackend` base with the graph hooks over static buffers, as the module
    docstring says; a backend derives from it instead of `AttentionBackend`."""

    supports_graphs: ClassVar[bool] = True
    _static: dict[str, torch.Tensor] | None = None
    _block_size: int = 16

    def init_capture(
        self, max_bs: int, max_blocks_per_seq: int, device: torch.device, block_size: int
    ) -> None:
        if min(max_bs, max_blocks_per_seq, block_size) < 1:
            raise ValueError("init_capture needs at least one sequence, one block, block size")
        i32 = torch.int32
        self._block_size = block_size
        self._static = {
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=i32, device=device),
            "seq_lens_k": torch.zeros(max_bs, dtype=i32, device=device),
            "block_table": torch.zeros(max_bs, max_blocks_per_seq, dtype=i32, device=device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=device),
        }

    def _buffers(self, bs: int) -> dict[str, torch.Tensor]:
        static = self._static
        if static is None:
            raise RuntimeError("init_capture must run before a capture or a replay")
        if not 1 <= bs <= static["seq_lens_k"].shape[0]:
            raise ValueError(f"batch size {bs} is outside the captured range")
        return static

    def prepare_for_capture(self, bs: int, max_seqlen_k: int) -> AttentionMetadata:
        static = self._buffers(bs)
        static["seq_lens_k"][:bs].zero_()
        static["slot_mapping"][:bs].fill_(-1)
        meta = AttentionMetadata(
            cu_seqlens_q=static["cu_seqlens_q"][: bs + 1],
            seq_lens_k=static["seq_lens_k"][:bs],
            block_table=static["block_table"][:bs],
            slot_mapping=static["slot_mapping"][:bs],
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            block_size=self._block_size,
        )
        self.prepare(meta)
        return meta

    def prepare_for_replay(self, bs: int, meta: AttentionMetadata) -> None:
        static = self._buffers(bs)
        n, width = meta.block_table.shape
        if meta.max_seqlen_q != 1 or meta.num_tokens != n or n > bs:
            raise ValueError(
                f"a replay takes a decode step of at most {bs} sequences, one query each "
                f"(got {meta.num_tokens} tokens over {n} sequences)"
            )
        if width > static["block_table"].shape[1]:
            raise ValueError(f"a block table of {width} blocks exceeds the captured width")
        static["seq_lens_k"][:n].copy_(meta.seq_lens_k, non_blocking=True)
        static["block_table"][:n, :width].copy_(meta.block_table, non_blocking=True)
        static["slot_mapping"][:n].copy_(meta.slot_mapping, non_blocking=True)
        if n < bs:
            static["seq_lens_k"][n:bs].zero_()
            static["slot_mapping"][n:bs].fill_(-1)
