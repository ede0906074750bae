"""The static decode metadata behind CUDA graphs (`kernels.graph_metadata`), on the Triton
backend (its hooks are plain tensor copies: no kernel runs here, so no GPU or interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.interface import AttentionMetadata
from kernels.triton_paged import TritonPagedBackend, TritonState


def live(k_lens: list[int], tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
    n = len(k_lens)
    return AttentionMetadata(
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        max_seqlen_q=1,
        max_seqlen_k=max(k_lens),
    )


def captured(bs: int = 4) -> tuple[TritonPagedBackend, AttentionMetadata]:
    backend = TritonPagedBackend()
    backend.init_capture(6, 5, torch.device("cpu"), 16)
    return backend, backend.prepare_for_capture(bs, 512)


def test_capture_metadata_reads_no_key_and_writes_no_slot():
    backend, meta = captured(4)
    assert backend.supports_graphs
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens_k.tolist() == [0] * 4 and meta.slot_mapping.tolist() == [-1] * 4
    assert meta.block_table.shape == (4, 5)
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size) == (1, 512, 16)
    assert isinstance(meta.state, TritonState)  # prepared before the capture


def test_replay_copies_the_live_step_and_pads_the_rest():
    backend, meta = captured(4)
    backend.prepare_for_replay(4, live([5, 6, 7, 8], [[1], [2], [3], [4]], [10, 20, 30, 40]))
    step = live([33, 2], [[7, 8, 9], [6, 0, 0]], [32 + 16 * 9, 1 + 16 * 6])
    backend.prepare_for_replay(4, step)  # fewer sequences in the same bucket
    assert meta.seq_lens_k.tolist() == [33, 2, 0, 0]
    assert meta.slot_mapping.tolist() == [176, 97, -1, -1]
    assert meta.block_table[:2, :3].tolist() == [[7, 8, 9], [6, 0, 0]]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]


def test_hooks_refuse_what_no_graph_holds():
    backend = TritonPagedBackend()
    with pytest.raises(RuntimeError, match="init_capture"):
        backend.prepare_for_capture(1, 512)
    backend, _ = captured(4)
    with pytest.raises(ValueError, match="batch size 7"):
        backend.prepare_for_capture(7, 512)
    with pytest.raises(ValueError, match="at most 2 sequences"):
        backend.prepare_for_replay(2, live([3, 3, 3], [[1], [2], [3]], [1, 2, 3]))
    prefill = live([3], [[1]], [1, 2, 3])  # three tokens of one sequence
    prefill.max_seqlen_q = 3
    with pytest.raises(ValueError, match="one query each"):
        backend.prepare_for_replay(4, prefill)
    with pytest.raises(ValueError, match="exceeds the captured width"):
        backend.prepare_for_replay(4, live([97], [list(range(7))], [96]))
