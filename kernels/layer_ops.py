"""A decoder layer's element-wise stages behind one interface: torch ops or fused kernels.

The stages are RMSNorm with the residual add before it, RoPE and SiLU-and-multiply. The
model (engine/models/llama.py) calls them through a `LayerOps`:

    x, residual = ops.add_rms_norm(h, residual, weight, eps)  # residual None: norm(h), h
    q = ops.rope(q, cos, sin)                                  # may rotate q in place
    a = ops.silu_mul(gate_up)                                  # [T, 2I] -> [T, I]
    q = ops.rope_write_kv(q, k, v, cos, sin, kv_cache, slots)  # when `fuses_kv_write`

The last is RoPE fused with the K/V write into the paged cache: a model calls it instead of
`rope` and its attention backend's `write_kv` when the ops fuse it and the backend's cache
is the standard one (`AttentionBackend.standard_kv_write`).

* `TorchOps` runs HF Llama's own ops in HF's order: the reference, and the only choice
  where Triton cannot run.
* `TritonOps` runs one kernel per stage (kernels.triton.fused), four launches a layer
  (two norms, RoPE with the K/V write, SiLU) where torch takes about twenty. It rounds
  where torch rounds, so in 16-bit dtypes the outputs agree bit for bit, but for the norm's
  float32 sum of squares, summed in another order (see that module).

`select_layer_ops(fused, device=..., dtype=..., shape=...)` picks: False, torch; True,
Triton or a ValueError saying why not; None (the default), Triton where it runs and passes a
smoke check against `TorchOps` on the device at the model's own sizes, else torch. It logs
its choice and the reason. "Where it runs" is CUDA (compute capability 8.0+), and the CPU
only inside a process that imported triton under `TRITON_INTERPRET=1` and still has it set
(tests), as for the Triton attention backend.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kernels.kv_write import write_kv

log = logging.getLogger("firstlight.kernels")


@dataclass(frozen=True, slots=True)
class LayerShape:
    """A model's sizes that the layer ops run at (the smoke check tries these)."""

    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool = False  # per-head q/k RMSNorms before RoPE (Qwen3)

    @property
    def rotary_heads(self) -> int:
        """q and k heads, rotated together."""
        return self.heads + self.kv_heads


TOY_SHAPE = LayerShape(hidden=96, heads=6, kv_heads=3, head_dim=32, intermediate=80)


class LayerOps(ABC):
    name: ClassVar[str]
    fuses_kv_write: ClassVar[bool] = False  # `rope_write_kv` runs

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rms_norm(h) * weight, h)` with `h = residual + x`, or `h = x` when `residual` is
        None. `h` may be `residual` updated in place; the caller must not reuse the old one."""

    @abstractmethod
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x: [T, heads, head_dim]` rotated by `cos`, `sin: [T, 1, head_dim // 2]` (the
        "rotate half" convention); may rotate `x` in place and return it."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `gate_up: [T, 2 * I]` (gate first): `[T, I]`."""

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Ops with `fuses_kv_write` only: `q` rotated in place and returned; `k` rotated
        and `v` stored at `slot_mapping` of the standard paged caches (`[num_blocks,
        block_size, kv_heads, head_dim]`; a negative slot writes nothing). `k` itself may stay
        unrotated. With `qk_norm = (q_weight, k_weight, eps)` each q and k head is first
        normalised as `rms_norm(head, weight, eps)` (Qwen3's q/k norms)."""
        raise NotImplementedError(f"{self.name} ops do not write the KV cache")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, round to the input dtype, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [T, heads, head_dim]`; equals HF's `x * cos + rotate_half(x) * sin`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchOps(LayerOps):
    name = "torch"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else residual + x
        return rms_norm(h, weight, eps), h

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps(LayerOps):
    name = "triton"
    fuses_kv_write = True

    def __init__(self) -> None:
        from kernels.triton import fused

        self._fused = fused

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fused.add_rms_norm(x, residual, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._fused.rope_(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fused.silu_mul(gate_up)

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        return self._fused.rope_write_kv(q, k, v, cos, sin, *kv_cache, slot_mapping, qk_norm)


def triton_ops_why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `TritonOps` cannot run on `device` in `dtype` (None: it can)."""
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        from kernels.triton import fused
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    interpreted = isinstance(fused.rope_kernel, InterpretedFunction)
    if interpreted != isinstance(triton.language.standard.cdiv, InterpretedFunction):
        return "TRITON_INTERPRET changed between importing triton and kernels.triton"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if interpreted:
            return "the Triton kernels were built for the interpreter (TRITON_INTERPRET=1)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "the GPU is older than compute capability 8.0 (untested there)"
    elif device.type != "cpu" or not (interpreted and triton.knobs.runtime.interpret):
        return f"device {device} is not CUDA (Triton runs on CPU only under TRITON_INTERPRET=1)"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not float16, bfloat16 or float32"
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "Triton's interpreter does not support bfloat16"
    return None


def smoke_check(
    ops: LayerOps, device: torch.device, dtype: torch.dtype, shape: LayerShape = TOY_SHAPE
) -> str | None:
    """Run each of `ops`' stages on three tokens of random inputs at `shape` (the model's
    sizes: those are the kernel variants it will launch) and compare with `TorchOps`; the
    first disagreement or error, or None."""
    reference = TorchOps()
    g = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    hidden, rotary, head_dim = shape.hidden, shape.rotary_heads, shape.head_dim
    x, res, w = rand(3, hidden), rand(3, hidden), rand(hidden)
    # q, k and v heads as a fused projection's output: the stages run on strided views
    qkv = rand(3, rotary + shape.kv_heads, head_dim)
    cos, sin = rand(3, 1, head_dim // 2), rand(3, 1, head_dim // 2)
    gate_up = rand(3, 2 * shape.intermediate)
    norms = (rand(head_dim), rand(head_dim), 1e-6) if shape.qk_norm else None

    # a 2-block cache of 4 slots a block; -1 is a graph bucket's padding row (writes nothing)
    slots = torch.tensor([5, -1, 2], device=device)

    def rope_write_kv(o: LayerOps) -> tuple[torch.Tensor, ...]:
        q, k, v = qkv.clone().split([shape.heads, shape.kv_heads, shape.kv_heads], dim=1)
        cache = torch.zeros(2, 2, 4, shape.kv_heads, head_dim, device=device, dtype=dtype)
        if o.fuses_kv_write:
            q = o.rope_write_kv(q, k, v, cos, sin, (cache[0], cache[1]), slots, norms)
        else:
            if norms is not None:
                q, k = rms_norm(q, norms[0], norms[2]), rms_norm(k, norms[1], norms[2])
            q, k = o.rope(q, cos, sin), o.rope(k, cos, sin)
            kept = slots >= 0
            write_kv(k[kept], v[kept], cache[0], cache[1], slots[kept])
        return q, cache

    def stages(o: LayerOps) -> dict[str, torch.Tensor]:
        outs = {
            "add_rms_norm": o.add_rms_norm(x.clone(), res.clone(), w, 1e-6),
            "rms_norm": o.add_rms_norm(x.clone(), None, w, 1e-6),
            "rope": (o.rope(qkv.clone()[:, :rotary], cos, sin),),
            "silu_mul": (o.silu_mul(gate_up),),
        }
        if ops.fuses_kv_write:
            outs["rope_write_kv"] = rope_write_kv(o)
        return {k: torch.cat([t.float().flatten() for t in v]) for k, v in outs.items()}

    try:
        want = stages(reference)
        for stage, got in stages(ops).items():
            if not torch.allclose(got, want[stage], rtol=tol, atol=tol):
                return f"{stage} differs from torch by {(got - want[stage]).abs().max():.3g}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def select_layer_ops(
    fused: bool | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    shape: LayerShape = TOY_SHAPE,
) -> LayerOps:
    """The ops a model of `shape` on `device` in `dtype` runs its element-wise stages with
    (see the module docstring); raises ValueError when `fused` is True and the kernels
    cannot run."""
    where = f"device={device}, dtype={dtype}"
    if fused is False:
        log.info("layer ops torch chosen by config for %s", where)
        return TorchOps()
    reason = triton_ops_why_not(device, dtype)
    ops: LayerOps | None = None
    if reason is None:
        ops = TritonOps()
        reason = smoke_check(ops, device, dtype, shape)
    if reason is None and ops is not None:
        log.info("layer ops triton (fused kernels) chosen for %s", where)
        return ops
    if fused:
        raise ValueError(f"fused layer ops cannot run on {where}: {reason}")
    log.info("layer ops torch chosen for %s; fused kernels skipped: %s", where, reason)
    return TorchOps()
