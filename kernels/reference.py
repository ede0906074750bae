"""Paged causal attention in plain torch: correct everywhere, and lean enough to serve on CPU.

The whole varlen batch runs in a handful of tensor ops per layer. Once per step, `prepare`
turns the block tables into flat slot ids (`[B, max_k]`), the packed queries into rows of a
padded `[B, max_q]` grid, and the sequence lengths into a boolean mask (key in range and
bottom-right causal), kept in the step's `ReferenceState`. Each layer then gathers K/V from
the flat cache and runs torch's `scaled_dot_product_attention` over the padded grid (float32
accumulation, tiled on CPU, and rows that see no key come out as zeros, never NaN), then
packs the rows back.

GQA never repeats K/V: decode steps (one query per sequence) fold each KV head's query heads
into the query rows (`[B, kv_heads, group, d]`); longer queries use SDPA's native GQA.
Layout work is skipped where it is the identity: when every sequence has the same query
length the queries need no scatter, a lone sequence needs no length mask, and a lone
sequence with as many queries as keys is plain causal. These shortcuts trust the contract
that `max_seqlen_q` / `max_seqlen_k` are the maxima of the true lengths, so no tensor is read
back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.interface import AttentionBackend, AttentionMetadata, BackendState, KVCache
from kernels.registry import register_backend


@dataclass(slots=True)
class Plan:
    """Per-step layout shared by every layer."""

    num_seqs: int
    max_q: int
    max_k: int
    blocks: torch.Tensor  # [B * ceil(max_k / block_size)] int64 block ids, gathered whole
    q_index: torch.Tensor | None  # [num_tokens] row of each packed query in the padded grid
    attend: torch.Tensor | None  # [B, 1, max_q, max_k] bool, True = the query sees the key
    causal: bool  # square causal attention of one sequence: SDPA's own mask, no tensor


def _build_plan(
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_table: torch.Tensor,
    max_q: int,
    max_k: int,
    block_size: int,
    num_tokens: int,
) -> Plan:
    device = seq_lens_k.device
    num_seqs = int(seq_lens_k.shape[0])
    j = torch.arange(max_k, device=device)
    # Whole blocks are gathered (rows of block_size * kv_heads * head_dim: ~3x faster than a
    # per-slot gather on CPU); entries past a sequence's length are masked, never read as
    # keys; the block table's padding may hold any value, so it is replaced by block 0.
    table = block_table[:, : (max_k + block_size - 1) // block_size].long()
    if num_seqs == 1:
        # One sequence: every key up to max_k is in range; only causality can hide keys.
        attend = None
        if 1 < max_q < max_k:
            r = torch.arange(max_q, device=device)
            attend = (j[None, :] <= r[:, None] + (max_k - max_q)).view(1, 1, max_q, max_k)
        causal = 1 < max_q == max_k
        return Plan(1, max_q, max_k, table.reshape(-1), None, attend, causal)
    lens_k = seq_lens_k.long()
    cu = cu_seqlens_q.long()
    lens_q = cu[1:] - cu[:-1]
    in_range = j[None, :] < lens_k[:, None]  # [B, max_k]
    used = torch.arange(table.shape[1], device=device)[None, :] * block_size < lens_k[:, None]
    blocks = table.masked_fill(~used, 0).reshape(-1)
    r = torch.arange(max_q, device=device)
    visible = j[None, None, :] <= r[None, :, None] + (lens_k - lens_q)[:, None, None]
    attend = (visible & in_range[:, None, :])[:, None]  # [B, 1, max_q, max_k]
    if num_tokens == num_seqs * max_q:
        q_index = None  # every sequence has max_q queries: packed == padded
    else:
        seqs = torch.arange(num_seqs, device=device)
        seq_of_token = torch.repeat_interleave(seqs, lens_q, output_size=num_tokens)
        row = torch.arange(num_tokens, device=device) - cu[seq_of_token]
        q_index = seq_of_token * max_q + row
    return Plan(num_seqs, max_q, max_k, blocks, q_index, attend, False)


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query row per (sequence, head): two batched matmuls over the strided K/V views.

    On CPU this beats SDPA's flash kernel for q_len 1, which copies the strided gathered K/V
    and tiles for long queries. Accumulates in float32 for half-precision inputs.
    """
    dtype = q.dtype
    if dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if attend is not None:
        scores.masked_fill_(~attend, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row with no key gives zeros
    return torch.matmul(probs, v).to(dtype)


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together: all decodes (one query each), or all longer queries.

    Mixing them would pad every decode row to the longest prefill chunk. `tokens` holds the
    packed query rows of the group (None: the group is the whole step, in order); the group's
    own metadata tensors are kept for kernels that read the paged cache directly.
    """

    plan: Plan
    tokens: torch.Tensor | None
    seq_lens_k: torch.Tensor
    block_table: torch.Tensor


@dataclass(slots=True)
class ReferenceState(BackendState):
    """The reference backend's per-step state: the step split into groups, each planned."""

    groups: list[AttentionGroup]


def _build_groups(
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_table: torch.Tensor,
    max_q: int,
    max_k: int,
    block_size: int,
    num_tokens: int,
) -> list[AttentionGroup]:
    num_seqs = int(seq_lens_k.shape[0])
    if max_q == 1 or num_seqs == 1 or num_tokens == num_seqs * max_q:
        plan = _build_plan(
            cu_seqlens_q, seq_lens_k, block_table, max_q, max_k, block_size, num_tokens
        )
        return [AttentionGroup(plan, None, seq_lens_k, block_table)]
    # A host read of the query lengths: this is the reference path (CPU, or a fallback).
    cu = cu_seqlens_q.tolist()
    lens_k = seq_lens_k.tolist()
    decode = [i for i in range(num_seqs) if cu[i + 1] - cu[i] == 1]
    longer = [i for i in range(num_seqs) if cu[i + 1] - cu[i] > 1]
    groups = []
    for seqs in (decode, longer):
        if not seqs:
            continue
        device = seq_lens_k.device
        rows: list[int] = []
        sub_cu = [0]
        for i in seqs:
            rows.extend(range(cu[i], cu[i + 1]))
            sub_cu.append(len(rows))
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        sub_lens = seq_lens_k.index_select(0, index)
        sub_table = block_table.index_select(0, index)
        sub_max_q = max(sub_cu[j + 1] - sub_cu[j] for j in range(len(seqs)))
        plan = _build_plan(
            torch.tensor(sub_cu, dtype=torch.int32, device=device),
            sub_lens,
            sub_table,
            sub_max_q,
            max(lens_k[i] for i in seqs),
            block_size,
            len(rows),
        )
        tokens = torch.tensor(rows, dtype=torch.int64, device=device)
        groups.append(AttentionGroup(plan, tokens, sub_lens, sub_table))
    return groups


@register_backend(priority=0)
class TorchReferenceBackend(AttentionBackend[ReferenceState]):
    """Paged attention with torch ops; any device, float32/bfloat16/float16, any shape."""

    name = "torch_ref"
    state_type: type[ReferenceState] = ReferenceState

    @classmethod
    def why_not(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {dtype} is not float32, bfloat16 or float16"
        if block_size <= 0:
            return f"block_size {block_size} is not positive"
        return None

    def build_state(self, meta: AttentionMetadata) -> ReferenceState:
        """The step's groups and their plans, shared by every layer."""
        return ReferenceState(
            _build_groups(
                meta.cu_seqlens_q,
                meta.seq_lens_k,
                meta.block_table,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                meta.block_size,
                meta.num_tokens,
            )
        )

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        state: ReferenceState,
        *,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        groups = state.groups
        if len(groups) == 1 and groups[0].tokens is None:
            o = self._attend(groups[0], q, k_cache, v_cache, state, scale)
            if out is None:
                return o
            return out.copy_(o)
        if out is None:
            out = torch.empty_like(q)
        for g in groups:
            assert g.tokens is not None
            o = self._attend(g, q.index_select(0, g.tokens), k_cache, v_cache, state, scale)
            out.index_copy_(0, g.tokens, o)
        return out

    def _attend(
        self,
        g: AttentionGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        state: ReferenceState,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one group; `q` holds exactly the group's packed query rows."""
        _, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        plan = g.plan
        b, max_q, max_k = plan.num_seqs, plan.max_q, plan.max_k

        # [B, kv_heads, max_k, d]: keys gathered through the block tables.
        k = k_cache.index_select(0, plan.blocks).view(b, -1, kv_heads, head_dim)
        v = v_cache.index_select(0, plan.blocks).view(b, -1, kv_heads, head_dim)
        k = k[:, :max_k].transpose(1, 2)
        v = v[:, :max_k].transpose(1, 2)
        if plan.q_index is not None:
            q = q.new_zeros(b * max_q, num_heads, head_dim).index_copy_(0, plan.q_index, q)

        if max_q == 1:  # decode: a KV head's query heads become its query rows
            o = _decode_attention(q.reshape(b, kv_heads, group, head_dim), k, v, plan.attend, scale)
            return o.reshape(b, num_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q.reshape(b, max_q, num_heads, head_dim).transpose(1, 2),
            k,
            v,
            attn_mask=plan.attend,
            is_causal=plan.causal,
            scale=scale,
            enable_gqa=group > 1,
        )
        o = o.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
        if plan.q_index is not None:
            o = o.index_select(0, plan.q_index)
        return o
