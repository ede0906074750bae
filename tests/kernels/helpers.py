"""Builders shared by the attention-kernel tests: paged cases with shuffled, non-contiguous
block tables, a float64 dense reference, and a model-like driver of a backend."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.kv_write import write_kv
from kernels.reference import TorchReferenceBackend

BLOCK = 16
GARBAGE = 1e4  # cache contents past each sequence's length: huge but finite


def step_metadata(
    shapes: list[tuple[int, int]],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """The metadata of one step over `shapes` ((q_len, k_len) per sequence, packed in order)."""
    q_lens = [q for q, _ in shapes]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        cu_seqlens_q=cu.to(device),
        seq_lens_k=torch.tensor([k for _, k in shapes], dtype=torch.int32, device=device),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k for _, k in shapes),
        block_size=block_size,
    )


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, d] packed queries
    k_new: torch.Tensor  # [T, kv_heads, d]: this step's keys, not yet in the cache
    v_new: torch.Tensor
    k_cache: torch.Tensor  # holds every earlier position; this step's slots hold garbage
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
    block_size: int = BLOCK,
) -> PagedCase:
    """`shapes` lists (q_len, k_len) per sequence; blocks are shuffled and non-contiguous.

    Only the positions before each sequence's new tokens are written to the cache: the
    backend's `forward` must write `k_new`/`v_new` itself. A sequence with more queries than
    keys (q_len > k_len) has all of its keys written and none new.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(k_len + block_size - 1) // block_size for _, k_len in shapes]
    num_blocks = 2 * sum(blocks_per_seq) + 3  # spare blocks stay garbage
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = (torch.randn(cache_shape, generator=g) * GARBAGE).to(dtype)
    v_cache = (torch.randn(cache_shape, generator=g) * GARBAGE).to(dtype)
    tables, dense_k, dense_v, slots, qs, k_new, v_new = [], [], [], [], [], [], []
    for (q_len, k_len), nb in zip(shapes, blocks_per_seq, strict=True):
        table = [order.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(k_len, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(k_len, kv_heads, head_dim, generator=g).to(dtype)
        seq_slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(k_len)]
        )
        old = max(0, k_len - q_len)  # positions already cached before this step
        write_kv(k[:old], v[:old], k_cache, v_cache, seq_slots[:old])
        dense_k.append(k)
        dense_v.append(v)
        slots.append(seq_slots[old:])
        k_new.append(k[old:])
        v_new.append(v[old:])
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype))
    width = max(blocks_per_seq)
    block_table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q for q, _ in shapes]
    meta = step_metadata(shapes, block_table, torch.cat(slots), block_size)
    return PagedCase(
        torch.cat(qs),
        torch.cat(k_new),
        torch.cat(v_new),
        k_cache,
        v_cache,
        meta,
        dense_k,
        dense_v,
        q_lens,
    )


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
    case: PagedCase,
    scale: float,
    *,
    use_prepare: bool,
    backend_cls: type[AttentionBackend] = TorchReferenceBackend,
    layers: int = 1,
) -> torch.Tensor:
    """`layers` forward calls on one metadata object, as a model's layers make them."""
    backend = backend_cls()
    meta = case.meta
    if use_prepare:
        state = backend.prepare(meta)
        assert meta.state is state and isinstance(state, backend.state_type)
    for _ in range(layers):
        out = backend.forward(
            case.q, case.k_new, case.v_new, meta, kv_cache=(case.k_cache, case.v_cache), scale=scale
        )
    return out


def copy_case(case: PagedCase, device: torch.device | str = "cpu") -> PagedCase:
    """The same case on `device` with caches of its own and metadata without a backend state,
    so several backends can each run it from the same starting cache."""

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, copy=True)

    m = case.meta
    meta = AttentionMetadata(
        cu_seqlens_q=to(m.cu_seqlens_q),
        seq_lens_k=to(m.seq_lens_k),
        block_table=to(m.block_table),
        slot_mapping=to(m.slot_mapping),
        max_seqlen_q=m.max_seqlen_q,
        max_seqlen_k=m.max_seqlen_k,
        block_size=m.block_size,
    )
    return PagedCase(
        to(case.q),
        to(case.k_new),
        to(case.v_new),
        to(case.k_cache),
        to(case.v_cache),
        meta,
        case.dense_k,
        case.dense_v,
        case.q_lens,
    )


def forward(backend: AttentionBackend, case: PagedCase, scale: float) -> torch.Tensor:
    """One layer's `forward` of `backend` on the case (writes the new K/V into its caches)."""
    kv = (case.k_cache, case.v_cache)
    return backend.forward(case.q, case.k_new, case.v_new, case.meta, kv_cache=kv, scale=scale)


def triton_kernel_device() -> torch.device:
    """Import triton and `kernels.triton_paged` so that the kernels can run in this process,
    and return where: CUDA when there is a GPU, else the CPU through Triton's interpreter
    (`TRITON_INTERPRET=1` set while they import, then restored; each test must set it again
    while it launches, see test_triton_paged.py). Skips the calling test module when triton is
    not installed or was already imported here outside the interpreter."""
    if not torch.cuda.is_available() and "triton" in sys.modules:
        interpreter = sys.modules.get("triton.runtime.interpreter")
        if interpreter is None or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(
                "triton was imported outside the interpreter in this process: "
                "test_triton_interpreter.py runs this module in a fresh one",
                allow_module_level=True,
            )
    saved = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="triton is not installed")
        from kernels import triton_paged
        from kernels.triton import fused  # noqa: F401 - decorated in the same mode
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    if triton_paged.interpreted():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
