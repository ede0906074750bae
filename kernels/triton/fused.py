"""A decoder layer's small element-wise stages, one kernel each instead of several.

In a decode step the matmuls stream the weights; what sits between them (norms, residual
adds, RoPE, SiLU) is a handful of tiny element-wise ops, each a kernel launch of a few
microseconds that reads and writes a few kilobytes. Unfused, a Llama layer launches about
twenty of them; at batch 1 on a GPU their launches add up to a large part of the step. Each
kernel here replaces several of torch's and rounds where torch's sequence rounds, so the
results match `kernels.layer_ops.TorchOps` bit for bit in 16-bit dtypes, except for
the norm's float32 sum of squares (summed in another order: rarely, one unit in the last
place):

* `add_rms_norm`: `residual += x` (rounded to the model dtype, as torch's add is), then
  HF's RMSNorm of it (float32 statistics, the normalised row rounded to the model dtype
  before the weight scales it). One program per token row.
* `rope_`: rotates `x: [T, heads, head_dim]` in place, the "rotate half" convention, each
  product and sum rounded to the model dtype as torch's ops round them. One program per
  token.
* `rope_write_kv`: `rope_` of the query heads, and the key heads rotated and stored with
  the value heads at their cache slots: the RoPE and the K/V write of a layer in one launch
  (`kernels.triton.kv_write`'s contract: a negative slot writes nothing), with Qwen3's
  per-head q/k RMSNorms before the rotation when the model has them. One program per token.
* `silu_mul`: `silu(gate) * up` of a fused `[T, 2 * I]` gate/up projection, SiLU's output
  rounded to the model dtype first as torch's two ops do. Programs over (token, column tile).

Grids come from tensor shapes and every length is a tensor shape or a per-model constant, so
the launches are static and live in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SCALE_IN_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(residual + row * stride_r + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / HIDDEN + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    y = _scaled(hf * inv, w, h.dtype, SCALE_IN_DTYPE)
    tl.store(out + row * stride_o + cols, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _scaled(normed, w, dt, SCALE_IN_DTYPE: tl.constexpr):
    """RMSNorm's last step, float32: HF rounds the normalised value to the model dtype `dt`
    before the weight scales it (SCALE_IN_DTYPE, the 16-bit dtypes)."""
    if SCALE_IN_DTYPE:
        return normed.to(dt).to(tl.float32) * w
    return normed * w


@triton.jit
def _cos_sin(cos, sin, token, stride_ct, stride_st, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """A token's `[HALF]` cos and sin rows, float32."""
    cols = tl.arange(0, HALF_PAD)
    c = tl.load(cos + token * stride_ct + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin + token * stride_st + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _load_heads(
    first,
    mask,
    norm_weight,
    eps,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    SCALE_IN_DTYPE: tl.constexpr,
):
    """The two halves (`[heads, HALF]` each) of the heads whose first halves are at `first`;
    with NORM, each head normalised first: HF's RMSNorm over head_dim with `norm_weight`
    (Qwen3's q/k norms), rounded where `add_rms_norm_kernel` rounds."""
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    if NORM:
        dt = x1.dtype
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        cols = tl.arange(0, HALF_PAD)
        w1 = tl.load(norm_weight + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_weight + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = _scaled(a * inv[:, None], w1[None, :], dt, SCALE_IN_DTYPE).to(dt)
        x2 = _scaled(b * inv[:, None], w2[None, :], dt, SCALE_IN_DTYPE).to(dt)
    return x1, x2


@triton.jit
def _rotated(x1, x2, c, s):
    """The "rotate half" rotation of halves `x1`, `x2` (`[heads, HALF]`) by `c`, `s`
    (`[HALF]`, float32): `(lo, hi)` in the halves' dtype. torch rounds each product to the
    model dtype, then their sum, so this does too (a product of two 16-bit values is exact
    in float32, and the casts keep it from fusing into an FMA)."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    dt = x1.dtype
    ac = (a * c[None, :]).to(dt).to(tl.float32)
    bs = (b * s[None, :]).to(dt).to(tl.float32)
    bc = (b * c[None, :]).to(dt).to(tl.float32)
    as_ = (a * s[None, :]).to(dt).to(tl.float32)
    return (ac - bs).to(dt), (bc + as_).to(dt)


@triton.jit
def _rotate_heads_(
    x,
    stride_h,
    c,
    s,
    norm_weight,
    eps,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    SCALE_IN_DTYPE: tl.constexpr,
):
    """Rotate one token's `HEADS` heads at `x` (head stride `stride_h`) in place (each
    normalised first, with NORM)."""
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < HEADS) & (cols[None, :] < HALF)
    first = x + heads[:, None] * stride_h + cols[None, :]
    x1, x2 = _load_heads(first, mask, norm_weight, eps, HALF, HALF_PAD, NORM, SCALE_IN_DTYPE)
    lo, hi = _rotated(x1, x2, c, s)
    tl.store(first, lo, mask=mask)
    tl.store(first + HALF, hi, mask=mask)


@triton.jit
def rope_kernel(
    x,
    cos,
    sin,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    c, s = _cos_sin(cos, sin, token, stride_ct, stride_st, HALF, HALF_PAD)
    _rotate_heads_(
        x + token * stride_xt, stride_xh, c, s, x, 0.0, HEADS, HEADS_PAD, HALF, HALF_PAD,
        False, False,
    )  # fmt: skip


@triton.jit
def rope_write_kv_kernel(
    q,
    k,
    v,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_mapping,
    q_norm,
    k_norm,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    SCALE_IN_DTYPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    c, s = _cos_sin(cos, sin, token, stride_ct, stride_st, HALF, HALF_PAD)
    _rotate_heads_(
        q + token * stride_qt, stride_qh, c, s, q_norm, eps, HEADS, HEADS_PAD, HALF, HALF_PAD,
        NORM, SCALE_IN_DTYPE,
    )  # fmt: skip
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:  # a negative slot (a graph bucket's padding row) writes nothing
        block = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        kv = tl.arange(0, KV_PAD)
        cols = tl.arange(0, HALF_PAD)
        kv_mask = (kv[:, None] < KV_HEADS) & (cols[None, :] < HALF)
        k_src = k + token * stride_kt + kv[:, None] * stride_kh + cols[None, :]
        k1, k2 = _load_heads(k_src, kv_mask, k_norm, eps, HALF, HALF_PAD, NORM, SCALE_IN_DTYPE)
        k_lo, k_hi = _rotated(k1, k2, c, s)
        k_dst = k_cache + block * stride_kcb + row * stride_kcs + kv[:, None] * stride_kch
        k_dst += cols[None, :]
        tl.store(k_dst, k_lo.to(k_cache.dtype.element_ty), mask=kv_mask)
        tl.store(k_dst + HALF, k_hi.to(k_cache.dtype.element_ty), mask=kv_mask)
        v_src = v + token * stride_vt + kv[:, None] * stride_vh + cols[None, :]
        v_dst = v_cache + block * stride_vcb + row * stride_vcs + kv[:, None] * stride_vch
        v_dst += cols[None, :]
        for half in tl.static_range(2):
            values = tl.load(v_src + half * HALF, mask=kv_mask, other=0.0)
            tl.store(v_dst + half * HALF, values.to(v_cache.dtype.element_ty), mask=kv_mask)


@triton.jit
def silu_mul_kernel(
    gate_up,
    out,
    stride_g,
    stride_o,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < SIZE
    g = tl.load(gate_up + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(gate_up + row * stride_g + SIZE + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch rounds SiLU's output, then multiplies
    tl.store(out + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=mask)  # fmt: skip


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(h) * weight, h)` where `h = residual + x` (written into `residual`) or
    `h = x` without a residual. Rows of `x`/`residual` are `[T, hidden]`, last dim contiguous."""
    num_tokens, hidden = x.shape
    assert x.stride(-1) == 1 and weight.shape == (hidden,), (x.stride(), weight.shape)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x
        add_rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            SCALE_IN_DTYPE=x.dtype != torch.float32, num_warps=_warps(block),
        )  # fmt: skip
    return out, residual if residual is not None else x


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [T, heads, head_dim]` in place (head_dim contiguous; any token and head
    strides, e.g. the q/k heads of a fused projection) by `cos`, `sin: [T, 1, head_dim // 2]`;
    returns `x`."""
    num_tokens, heads, head_dim = x.shape
    half = head_dim // 2
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.shape[-1] == sin.shape[-1] == half and cos.shape[0] == sin.shape[0] == num_tokens
    if num_tokens:
        rope_kernel[(num_tokens,)](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            num_warps=_warps(triton.next_power_of_2(heads) * triton.next_power_of_2(half)),
        )  # fmt: skip
    return x


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """`rope_(q)`, and `k` rotated and `v` stored at `slot_mapping[t]` of the caches, in one
    launch: what `rope_` on q and k followed by `kernels.triton.kv_write.write_kv` does,
    except that `k` itself is left unrotated (only the cache holds its rotation). With
    `qk_norm = (q_weight, k_weight, eps)`, each q and k head is RMS-normalised over head_dim
    first (Qwen3), as `rms_norm` does. `q`, `k`, `v`: `[T, heads, head_dim]` with head_dim
    contiguous (any token and head strides, e.g. views of a fused projection); caches
    `[num_blocks, block_size, kv_heads, head_dim]` (head_dim contiguous); a negative slot
    writes nothing. Returns `q`."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    half = head_dim // 2
    assert k.shape == v.shape == (num_tokens, kv_heads, head_dim), (k.shape, v.shape)
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, k_cache, v_cache))
    assert cos.shape[-1] == sin.shape[-1] == half and cos.shape[0] == sin.shape[0] == num_tokens
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    if qk_norm is not None:
        assert q_norm.shape == k_norm.shape == (head_dim,), (q_norm.shape, k_norm.shape)
    if num_tokens:
        heads_pad, kv_pad = triton.next_power_of_2(heads), triton.next_power_of_2(kv_heads)
        half_pad = triton.next_power_of_2(half)
        rope_write_kv_kernel[(num_tokens,)](
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HEADS=heads, HEADS_PAD=heads_pad, KV_HEADS=kv_heads, KV_PAD=kv_pad, HALF=half,
            HALF_PAD=half_pad, BLOCK_SIZE=k_cache.shape[1], NORM=qk_norm is not None,
            SCALE_IN_DTYPE=q.dtype != torch.float32,
            num_warps=_warps(heads_pad * half_pad),
        )  # fmt: skip
    return q


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up: [T, 2 * I]` (gate first), as a new `[T, I]` tensor."""
    num_tokens, double = gate_up.shape
    size = double // 2
    assert gate_up.stride(-1) == 1 and double % 2 == 0, (gate_up.stride(), gate_up.shape)
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(SILU_BLOCK, triton.next_power_of_2(size))
        silu_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), SIZE=size, BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    return out
