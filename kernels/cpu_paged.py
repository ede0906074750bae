"""CPU paged attention: a small C++ kernel for decode rows, the torch reference for the rest.

Decode dominates serving, and on CPU the torch reference spends most of a decode step copying
K/V: it gathers every sequence's blocks into a padded tensor, then the batched matmuls copy
the strided views again. `csrc/cpu_paged_decode.cpp` reads K/V in place from the paged cache
(no gather, no padding), parallel over (sequence, kv head), sharing each K/V read across the
GQA group. Multi-token queries (prefill chunks) keep the reference's SDPA path.

The kernel is compiled on first use with the machine's C++ compiler (torch's cpp_extension,
`-O3 -march=native`) into `$FIRSTLIGHT_HOME/torch_extensions`, keyed by the source, the CPU
flags and the torch version. When compiling is impossible the backend reports itself
unsupported and the registry falls back to the reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from kernels.reference import AttentionGroup, TorchReferenceBackend
from kernels.registry import register_backend

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_decode.cpp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernel module, or None when it cannot be built here (logged once)."""
    if os.environ.get("FIRSTLIGHT_DISABLE_CPU_KERNEL"):
        return None
    try:
        from torch.utils import cpp_extension

        source = _SOURCE.read_text()
        key = hashlib.sha1(f"{source}{_cpu_flags()}{torch.__version__}".encode()).hexdigest()
        name = f"firstlight_cpu_paged_{key[:12]}"
        home = os.environ.get("FIRSTLIGHT_HOME") or str(Path.home() / ".cache" / "firstlight")
        build = Path(home) / "torch_extensions" / name
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, odd platform: use the reference
        log.warning("CPU paged-attention kernel unavailable (%s); using torch_ref", exc)
        return None


@register_backend(priority=10)
class CpuPagedBackend(TorchReferenceBackend):
    """Float32 on CPU: decode rows through the C++ kernel, longer queries through SDPA."""

    name = "cpu_paged"

    @classmethod
    def supports(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> bool:
        return (
            torch.device(device).type == "cpu"
            and dtype == torch.float32
            and block_size > 0
            and load_extension() is not None
        )

    def _attend(
        self,
        g: AttentionGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ext = load_extension()
        if g.plan.max_q != 1 or ext is None:
            return super()._attend(g, q, k_cache, v_cache, scale)
        if g.kernel_args is None:  # the same for every layer of this step
            g.kernel_args = (
                g.block_table.to(torch.int32).contiguous(),
                g.seq_lens_k.to(torch.int32).contiguous(),
                torch.arange(q.shape[0], dtype=torch.int64),
            )
        table, lens, rows = g.kernel_args
        q = q.contiguous()
        out = torch.empty_like(q)
        ext.paged_decode(q, k_cache, v_cache, table, lens, rows, scale, out)
        return out
