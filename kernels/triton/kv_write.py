"""Writing a step's new keys and values into the paged cache: one program per token.

The same contract as `kernels.kv_write.write_kv` (token `t` goes to flat slot
`slot_mapping[t]`, values cast to the cache dtype), on caches of any strides, plus one
extension: a negative slot means "write nothing", so a padded batch (a CUDA-graph bucket) can
mark its padding tokens without reserving slots for them. The grid is the number of tokens:
a static shape, no tensor read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k_new = tl.load(k + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    v_new = tl.load(v + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    k_dst = block * stride_kcb + row * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = block * stride_vcb + row * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_cache + k_dst, k_new.to(k_cache.dtype.element_ty), mask)
    tl.store(v_cache + v_dst, v_new.to(v_cache.dtype.element_ty), mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `k[t]`, `v[t]` (`[num_tokens, kv_heads, head_dim]`, last dim contiguous) at
    `slot_mapping[t]` of caches shaped `[num_blocks, block_size, kv_heads, head_dim]` (last dim
    contiguous); tokens with a negative slot are skipped."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip
