"""The FlashAttention backend (`kernels.flash_paged`) on a CUDA GPU against the torch
reference, at the serving sizes of test_triton_gpu.py, and its decode steps in CUDA graphs.
Skipped without CUDA or without a FlashAttention build that imports and passes its smoke
check (the reason is the skip's message).

Run on a GPU host: `pytest -m gpu tests/gpu/test_flash_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.interface import AttentionMetadata
from kernels.reference import TorchReferenceBackend
from tests.gpu.test_triton_gpu import (
    BF16_TOL,
    BLOCK,
    HEAD_DIM,
    decodes,
    make_step,
    mixed_64,
    usable,
)
from tests.gpu.test_triton_gpu import parity as check_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def flash_backend():
    from kernels.flash_paged import FlashPagedBackend

    return usable(FlashPagedBackend)


def test_decode_batch(flash_backend):
    check_parity(flash_backend(), make_step(decodes(64)), **BF16_TOL)


def test_mixed_batch(flash_backend):
    check_parity(flash_backend(), make_step(mixed_64()), **BF16_TOL)


def test_head_dim_64_float16(flash_backend):
    step = make_step(mixed_64(seed=2)[:16], dtype=torch.float16, head_dim=64)
    check_parity(flash_backend(), step, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("num_seqs", [3, 64])
def test_a_captured_decode_step_replays_with_new_lengths(flash_backend, num_seqs):
    """Through the graph hooks, as the runner drives them: capture bucket 64, then replay a
    live step of `num_seqs` (padded) after copying it in."""
    step = make_step(decodes(num_seqs, 200, 3000, seed=4))
    backend = flash_backend()
    width = step.meta.block_table.shape[1]
    backend.init_capture(64, width, torch.device("cuda"), BLOCK)
    meta = backend.prepare_for_capture(64, 4096)
    q = torch.zeros(64, *step.q.shape[1:], dtype=step.q.dtype, device="cuda")
    out = torch.empty_like(q)
    kv = (step.k_cache, step.v_cache)
    backend.attend(q, kv, meta, backend.prepare(meta), scale=HEAD_DIM**-0.5, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.attend(q, kv, meta, backend.prepare(meta), scale=HEAD_DIM**-0.5, out=out)
    live = step.meta
    backend.write_kv(step.k_new, step.v_new, kv, live)
    backend.prepare_for_replay(64, live)
    q[:num_seqs].copy_(step.q)
    graph.replay()
    ref = TorchReferenceBackend()
    ref_meta = AttentionMetadata(
        live.cu_seqlens_q, live.seq_lens_k, live.block_table, live.slot_mapping,
        1, live.max_seqlen_k, BLOCK,
    )  # fmt: skip
    want = ref.attend(step.q, kv, ref_meta, ref.prepare(ref_meta), scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(out[:num_seqs], want, **BF16_TOL)


def test_padding_slots_write_nothing(flash_backend):
    """A graph bucket's padding rows carry slot -1: the K/V write skips them (a plain
    `index_copy_` would take -1 as a device-side assert, which ends the CUDA context)."""
    step = make_step(decodes(4, 200, 600, seed=5))
    backend = flash_backend()
    slots = step.meta.slot_mapping.clone()
    padded = slots.clone()
    padded[2] = -1
    meta = AttentionMetadata(
        step.meta.cu_seqlens_q, step.meta.seq_lens_k, step.meta.block_table, padded,
        1, step.meta.max_seqlen_k, BLOCK,
    )  # fmt: skip
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    backend.write_kv(step.k_new, step.v_new, (k_cache, v_cache), meta)
    torch.cuda.synchronize()
    keep = torch.tensor([0, 1, 3], device="cuda")
    want_k, want_v = step.k_cache.clone(), step.v_cache.clone()
    kv_heads, head_dim = want_k.shape[-2:]
    want_k.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], step.k_new[keep])
    want_v.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], step.v_new[keep])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
