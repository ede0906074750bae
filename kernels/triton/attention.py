"""Paged causal attention over a whole mixed step in one launch, optionally split over keys.

Grid `(query tiles, kv heads, splits)`, sized from shapes alone so the launch can be captured
in a CUDA graph; programs that find no work exit at once.

Query tiles and GQA packing. A program owns `BLOCK_M` rows: `BLOCK_Q = BLOCK_M // GROUP`
consecutive query tokens of one sequence times the `GROUP` query heads that share one KV
head (row `r` is token `r // GROUP`, head `r % GROUP`), so each K/V tile is loaded once for
the whole group. Sequence `i` numbers its tiles from `cu_seqlens_q[i] // BLOCK_Q + i`: these
starts rise strictly and leave room for the sequence's `ceil(len_q / BLOCK_Q)` tiles, so
`num_tokens // BLOCK_Q + num_seqs` tiles cover any step of `num_tokens` tokens in `num_seqs`
sequences. A program finds its sequence by binary search over `cu_seqlens_q`; a tile past its
sequence's queries exits.

Key tiles. `TILE_N` keys per step of the loop, whatever the cache's `BLOCK_SIZE`: key `j`
lives in block `block_table[seq, j // BLOCK_SIZE]`, row `j % BLOCK_SIZE`, so a tile gathers
its rows from several blocks (or part of one). Row `r` sees keys `j <= context + q_pos(r)`
(bottom-right causal, `context = L_k - L_q`); the tiles every row sees in full run without a
score mask, the rest (the diagonal, the sequence's end) with it. Softmax is online, in
float32 and base 2 (`qk_scale` carries `log2(e)`); rows that see no key give zeros. Cache
offsets are int32 unless a cache spans 2^31 elements (`WIDE_OFFSETS`): int64 gather pointers
for a 64-key tile spill registers on sm_90.

Splits (flash decoding). With `NUM_SPLITS > 1`, split `s` takes the `s`-th of `NUM_SPLITS`
equal runs of the program's key tiles and writes its unnormalised output, running max and sum
(float32) to scratch; `kernels.triton.split_kv` merges them per (token, head). A split with
no tile writes max -inf and sum 0, which weigh nothing in the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.split_kv import SplitScratch, combine_splits


@triton.jit
def _find_sequence(cu_seqlens_q, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence `i` whose first tile, `cu_seqlens_q[i] // BLOCK_Q + i`, is <= tile."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    return lo


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_cache,
    v_cache,
    table_row,
    kv_head,
    last_key,
    tile_lo,
    tile_hi,
    seq_len_k,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt_col,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    """Fold key tiles `[tile_lo, tile_hi)` into the online softmax state `(acc, m_i, l_i)`."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n
        in_seq = pos < seq_len_k
        # The tile's rows, gathered through the block table.
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_bt_col, mask=in_seq, other=0)
        if WIDE_OFFSETS:
            block = block.to(tl.int64)
        row = pos % BLOCK_SIZE
        kv_mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)
        k_off = block[:, None] * stride_kb + row[:, None] * stride_ks + offs_d[None, :]
        k = tl.load(k_cache + kv_head * stride_kh + k_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL_MASK:
            s = tl.where(pos[None, :] <= last_key[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block[:, None] * stride_vb + row[:, None] * stride_vs + offs_d[None, :]
        v = tl.load(v_cache + kv_head * stride_vh + v_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# The step's sequence count and block-table width change from step to step: left
# unspecialised (Triton compiles a variant for ints equal to 1 and for multiples of 16),
# they cost no compile in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_row"])
def paged_attention_kernel(
    q,
    k_cache,
    v_cache,
    out,
    cu_seqlens_q,
    seq_lens_k,
    block_table,
    part_acc,
    part_max,
    part_sum,
    num_seqs,
    num_heads,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt_row,
    stride_bt_col,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(cu_seqlens_q, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence
    if first_q >= q_len:
        return
    seq_len_k = tl.load(seq_lens_k + seq)
    context = seq_len_k - q_len  # keys before the sequence's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_pos = first_q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_pos < q_len)
    token = (q_start + q_pos).to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q_tile = tl.load(q + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    last_key = context + q_pos

    # Tiles below `full` are seen whole by every row (the first row sees the fewest keys);
    # tiles up to `num_tiles` hold the last row's keys.
    num_keys = tl.maximum(context + tl.minimum(first_q + BLOCK_Q, q_len), 0)
    num_tiles = tl.cdiv(num_keys, TILE_N)
    full = tl.maximum(context + first_q + 1, 0) // TILE_N
    lo = 0
    hi = num_tiles
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_tiles)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = block_table + seq.to(tl.int64) * stride_bt_row
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q_tile, k_cache, v_cache, table_row, kv_head, last_key,
        lo, tl.minimum(hi, full), seq_len_k, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt_col,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, DOT_PRECISION, WIDE_OFFSETS,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q_tile, k_cache, v_cache, table_row, kv_head, last_key,
        tl.maximum(lo, full), hi, seq_len_k, qk_scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt_col,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION, WIDE_OFFSETS,
    )  # fmt: skip

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out + o_off, o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max + part, m_i, mask=row_ok)
        tl.store(part_sum + part, l_i, mask=row_ok)
        acc_off = part[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_acc + acc_off, acc, mask=row_ok[:, None] & d_ok[None, :])


LOG2E = 1.4426950408889634


def _span(t: torch.Tensor) -> int:
    """One past the largest element offset of `t` from its data pointer."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    block_m: int,
    tile_n: int,
    num_splits: int = 1,
    scratch: SplitScratch | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    wide_offsets: bool | None = None,
) -> None:
    """Attention of the packed `q` (`[num_tokens, num_heads, head_dim]`) over the paged caches,
    written into `out` (same shape). Any token/head/block strides; every last dim contiguous.

    `block_m` (query rows per program, a power of two >= 16 and >= the GQA group) and `tile_n`
    (keys per tile, a power of two >= 16) are the tile sizes; `num_splits > 1` splits every
    program's keys and needs `scratch` sized `[num_tokens, num_heads, num_splits]`. Reads no
    tensor back to the host. `wide_offsets` forces int64 (True) or int32 (False) cache
    offsets; None picks int64 only for caches that need it.
    """
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    block_q = block_m // group
    num_seqs = seq_lens_k.shape[0]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # no TF32 rounding for fp32
    if num_splits > 1:
        assert scratch is not None and scratch.max.shape == (num_tokens, num_heads, num_splits)
        parts: tuple[torch.Tensor, ...] = (scratch.acc, scratch.max, scratch.sum)
    else:
        parts = (out, out, out)  # never written: the kernel stores to `out` directly
    wide = wide_offsets
    if wide is None:
        wide = max(_span(k_cache), _span(v_cache)) >= 2**31
    grid = (num_tokens // block_q + num_seqs, kv_heads, num_splits)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens_k, block_table, *parts,
        num_seqs, num_heads, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), block_table.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=precision,
        WIDE_OFFSETS=wide,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        assert scratch is not None
        combine_splits(scratch, out)
