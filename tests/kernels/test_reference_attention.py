"""The torch reference backend against plain dense attention, one sequence at a time."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.cpu_paged import CpuPagedBackend
from kernels.interface import AttentionMetadata
from kernels.kv_write import write_kv
from kernels.reference import TorchReferenceBackend

BLOCK = 16
GARBAGE = 1e4  # cache contents past each sequence's length: huge but finite


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, d] packed queries
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per sequence [L_k, kv_heads, d]
    dense_v: list[torch.Tensor]
    q_lens: list[int]


def make_case(
    shapes: list[tuple[int, int]],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    """`shapes` lists (q_len, k_len) per sequence; blocks are shuffled and non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(k_len + BLOCK - 1) // BLOCK for _, k_len in shapes]
    num_blocks = 2 * sum(blocks_per_seq) + 3  # spare blocks stay garbage
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache_shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k_cache = (torch.randn(cache_shape, generator=g) * GARBAGE).to(dtype)
    v_cache = (torch.randn(cache_shape, generator=g) * GARBAGE).to(dtype)
    tables, dense_k, dense_v, slots, qs = [], [], [], [], []
    for (q_len, k_len), nb in zip(shapes, blocks_per_seq, strict=True):
        table = [order.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(k_len, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(k_len, kv_heads, head_dim, generator=g).to(dtype)
        seq_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(k_len)])
        write_kv(k, v, k_cache, v_cache, seq_slots)
        dense_k.append(k)
        dense_v.append(v)
        slots.append(seq_slots[k_len - q_len :])
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype))
    width = max(blocks_per_seq)
    block_table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q for q, _ in shapes]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens_k=torch.tensor([k for _, k in shapes], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat(slots),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k for _, k in shapes),
        block_size=BLOCK,
    )
    return PagedCase(torch.cat(qs), k_cache, v_cache, meta, dense_k, dense_v, q_lens)


def dense_attention(case: PagedCase, scale: float) -> torch.Tensor:
    """softmax(Q K^T) V per sequence in float64 with an explicit bottom-right causal mask."""
    outs, start = [], 0
    for k, v, q_len in zip(case.dense_k, case.dense_v, case.q_lens, strict=True):
        q = case.q[start : start + q_len].double()
        start += q_len
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [L_k, H, d]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        k_len = k.shape[0]
        rows = torch.arange(q_len)[:, None]
        cols = torch.arange(k_len)[None, :]
        scores = scores.masked_fill(cols > rows + (k_len - q_len), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv))
    return torch.cat(outs)


def run_backend(
    case: PagedCase, scale: float, *, use_prepare: bool, backend_cls=TorchReferenceBackend
) -> torch.Tensor:
    backend = backend_cls()
    meta = case.meta
    if use_prepare:
        backend.prepare(meta)
        assert backend.name in meta.extra
    return backend.forward(
        case.q,
        case.k_cache,
        case.v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens_k=meta.seq_lens_k,
        block_table=meta.block_table,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        scale=scale,
        meta=meta if use_prepare else None,
    )


LAYOUTS = {
    "mixed": [(1, 37), (5, 53), (20, 20), (1, 1), (9, 100)],  # decode, mid chunks, full
    "decode_batch": [(1, 17), (1, 3), (1, 64), (1, 31)],
    "equal_chunks": [(7, 7), (7, 40), (7, 23)],
    "single_full": [(45, 45)],
    "single_chunk": [(13, 77)],
    "single_decode": [(1, 70)],
}


def _cpu_kernel_backend():
    cpu = torch.device("cpu")
    if not CpuPagedBackend.supports(device=cpu, dtype=torch.float32, head_dim=64, block_size=BLOCK):
        pytest.skip("the C++ CPU kernel cannot be compiled here")
    return CpuPagedBackend


BACKENDS = {"torch_ref": lambda: TorchReferenceBackend, "cpu_paged": _cpu_kernel_backend}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("use_prepare", [True, False])
def test_matches_dense_attention(
    backend: str, layout: str, group: int, head_dim: int, use_prepare: bool
):
    backend_cls = BACKENDS[backend]()
    case = make_case(LAYOUTS[layout], num_heads=8, kv_heads=8 // group, head_dim=head_dim)
    scale = head_dim**-0.5
    got = run_backend(case, scale, use_prepare=use_prepare, backend_cls=backend_cls)
    want = dense_attention(case, scale)
    assert got.shape == case.q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_writes_into_out_and_prepare_is_shared_by_layers():
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=64)
    backend = TorchReferenceBackend()
    backend.prepare(case.meta)
    plan = case.meta.extra[backend.name]
    backend.prepare(case.meta)  # idempotent: the plan is built once per step
    assert case.meta.extra[backend.name] is plan
    out = torch.empty_like(case.q)
    got = backend.forward(
        case.q,
        case.k_cache,
        case.v_cache,
        cu_seqlens_q=case.meta.cu_seqlens_q,
        seq_lens_k=case.meta.seq_lens_k,
        block_table=case.meta.block_table,
        max_seqlen_q=case.meta.max_seqlen_q,
        max_seqlen_k=case.meta.max_seqlen_k,
        scale=0.125,
        out=out,
        meta=case.meta,
    )
    assert got is out
    torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=2e-5, rtol=1e-5)


def test_rows_without_visible_keys_stay_finite():
    # More queries than keys: the first rows of the second sequence see no key at all.
    case = make_case([(2, 9), (4, 2)], num_heads=4, kv_heads=4, head_dim=64)
    case.meta.slot_mapping = torch.arange(case.q.shape[0])  # one slot per query row
    for use_prepare in (True, False):
        out = run_backend(case, 0.125, use_prepare=use_prepare)
        assert torch.isfinite(out).all()
        # Rows that do see keys are still exact.
        want = dense_attention(case, 0.125)[:2]
        torch.testing.assert_close(out[:2].double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_dense(dtype: torch.dtype):
    case = make_case(LAYOUTS["mixed"], num_heads=8, kv_heads=2, head_dim=64, dtype=dtype)
    got = run_backend(case, 0.125, use_prepare=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), dense_attention(case, 0.125), atol=3e-2, rtol=3e-2)


def test_write_kv_targets_slots():
    k_cache = torch.zeros(4, BLOCK, 2, 8)
    v_cache = torch.zeros(4, BLOCK, 2, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    write_kv(k, v, k_cache, v_cache, torch.tensor([5, 3 * BLOCK, 2 * BLOCK + 15]))
    torch.testing.assert_close(k_cache[0, 5], k[0])
    torch.testing.assert_close(k_cache[3, 0], k[1])
    torch.testing.assert_close(v_cache[2, 15], v[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3
