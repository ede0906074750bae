"""A decoder layer's element-wise stages behind one interface: torch ops or fused kernels.

The stages are RMSNorm with the residual add before it, RoPE and SiLU-and-multiply. The
model (engine/models/llama.py) calls them through a `LayerOps`:

    x, residual = ops.add_rms_norm(h, residual, weight, eps)  # residual None: norm(h), h
    q = ops.rope(q, cos, sin)                                  # may rotate q in place
    a = ops.silu_mul(gate_up)                                  # [T, 2I] -> [T, I]

* `TorchOps` runs HF Llama's own ops in HF's order: the reference, and the only choice
  where Triton cannot run.
* `TritonOps` runs one kernel per stage (kernels.triton.fused), about four launches a layer
  where torch takes about twenty. It rounds where torch rounds, so in 16-bit dtypes the
  outputs agree bit for bit, but for the norm's float32 sum of squares, summed in another
  order (see that module).

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

log = logging.getLogger("firstlight.kernels")


@dataclass(frozen=True, slots=True)
class LayerShape:
    """A model's sizes that the layer ops run at (the smoke check tries these)."""

    hidden: int
    rotary_heads: int  # q and k heads, rotated together
    head_dim: int
    intermediate: int


TOY_SHAPE = LayerShape(hidden=96, rotary_heads=5, head_dim=32, intermediate=80)


class LayerOps(ABC):
    name: ClassVar[str]

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
    hidden, heads, head_dim = shape.hidden, shape.rotary_heads, shape.head_dim
    x, res, w = rand(3, hidden), rand(3, hidden), rand(hidden)
    qkv = rand(3, heads + 2, head_dim)  # q and k rotate as a strided view of a fused projection
    cos, sin = rand(3, 1, head_dim // 2), rand(3, 1, head_dim // 2)
    gate_up = rand(3, 2 * shape.intermediate)

    def stages(o: LayerOps) -> dict[str, torch.Tensor]:
        outs = {
            "add_rms_norm": o.add_rms_norm(x.clone(), res.clone(), w, 1e-6),
            "rms_norm": o.add_rms_norm(x.clone(), None, w, 1e-6),
            "rope": (o.rope(qkv.clone()[:, :heads], cos, sin),),
            "silu_mul": (o.silu_mul(gate_up),),
        }
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
