"""Flash decoding's second half: merging the partial results of key splits.

Split `s` of a (token, head) leaves its unnormalised output `acc_s`, running max `m_s` (base
2) and sum `l_s`; the merged output is `sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s` with
`M = max_s m_s`. A split that saw no key (max -inf, sum 0) weighs nothing; a row no split saw
comes out as zeros, as in the unsplit kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def combine_splits_kernel(
    part_acc,
    part_max,
    part_sum,
    out,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (token, head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    part = (token * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_sum + part, mask=s_ok, other=0.0)
    acc_off = part[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(part_acc + acc_off, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    den = tl.sum(w * l_s, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out + token * stride_ot + head * stride_oh + offs_d, o.to(out.dtype.element_ty), d_ok)


@dataclass(slots=True)
class SplitScratch:
    """Float32 partial results of a split launch, `[num_tokens, num_heads, splits(, d)]`."""

    acc: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def allocate(
        cls, num_tokens: int, num_heads: int, head_dim: int, splits: int, device: torch.device
    ) -> SplitScratch:
        shape = (num_tokens, num_heads, splits)
        f32 = torch.float32
        return cls(
            torch.empty((*shape, head_dim), dtype=f32, device=device),
            torch.empty(shape, dtype=f32, device=device),
            torch.empty(shape, dtype=f32, device=device),
        )


def combine_splits(scratch: SplitScratch, out: torch.Tensor) -> None:
    """Merge `scratch` into `out` (`[num_tokens, num_heads, head_dim]`, last dim contiguous)."""
    num_tokens, num_heads, splits, head_dim = scratch.acc.shape
    combine_splits_kernel[(num_tokens, num_heads)](
        scratch.acc, scratch.max, scratch.sum, out, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        NUM_SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
    )  # fmt: skip
