"""Writing a step's new keys and values into the paged KV cache.

Every backend reads K/V only through the cache, so each attention layer writes this step's
K/V before attention runs (through `write_kv`, or the fused RoPE + write kernel of
`kernels.layer_ops`); that is what lets `seq_lens_k` include this step's own tokens.
"""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token `t`'s `k[t]`, `v[t]` (`[num_tokens, kv_heads, head_dim]`) at flat slot
    `slot_mapping[t]` of caches shaped `[num_blocks, block_size, kv_heads, head_dim]`.

    The caches must be contiguous (the flat view shares their storage); slots must be distinct
    within one call. Values are cast to the cache dtype.
    """
    kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
