"""CPU paged attention: a small C++ kernel for decode rows, the torch reference for the rest.

Decode dominates serving, and on CPU the torch reference spends most of a decode step copying
K/V: it gathers every sequence's blocks into a padded tensor, then the batched matmuls copy
the strided views again. `csrc/cpu_paged_decode.cpp` reads K/V in place from the paged cache
(no gather, no padding), parallel over (sequence, kv head), sharing each K/V read across the
GQA group. Multi-token queries (prefill chunks) keep the reference's SDPA path.

The kernel is compiled on first use with the machine's C++ compiler (torch's cpp_extension,
`-O3 -march=native`) into `$FIRSTLIGHT_HOME/torch_extensions`, keyed by the source, the CPU
flags, the source path and the torch version. When compiling is impossible the backend
reports why (`why_not`) and the registry falls back to the reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kernels.interface import AttentionMetadata
from kernels.reference import AttentionGroup, ReferenceState, TorchReferenceBackend
from kernels.registry import register_backend

log = logging.getLogger("firstlight.kernels")

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
def _extension() -> ModuleType | str:
    """The compiled kernel module, or why it cannot be built here (logged once)."""
    if os.environ.get("FIRSTLIGHT_DISABLE_CPU_KERNEL"):
        return "disabled by FIRSTLIGHT_DISABLE_CPU_KERNEL"
    try:
        from torch.utils import cpp_extension

        source = _SOURCE.read_text()
        # The source path is in the key too: checkouts sharing one cache would otherwise keep
        # rebuilding the same directory, as its ninja file names the last checkout's source.
        key = f"{_SOURCE}{source}{_cpu_flags()}{torch.__version__}"
        key = hashlib.sha1(key.encode()).hexdigest()
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
        return f"the C++ kernel could not be built: {exc}"


def load_extension() -> ModuleType | None:
    """The compiled kernel module, or None when it cannot be built here."""
    ext = _extension()
    return None if isinstance(ext, str) else ext


@dataclass(slots=True)
class DecodeKernelArgs:
    """The decode group's metadata as the C++ kernel takes it, converted once per step."""

    block_table: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens_k: torch.Tensor  # [B] int32
    rows: torch.Tensor  # [B] int64: packed query row of each sequence


@dataclass(slots=True)
class CpuPagedState(ReferenceState):
    """The reference plan plus the decode group's kernel arguments (None: no decode group)."""

    decode: DecodeKernelArgs | None


@register_backend(priority=10)
class CpuPagedBackend(TorchReferenceBackend):
    """Float32 on CPU: decode rows through the C++ kernel, longer queries through SDPA."""

    name = "cpu_paged"
    state_type: type[ReferenceState] = CpuPagedState

    @classmethod
    def why_not(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> str | None:
        if torch.device(device).type != "cpu":
            return f"device {device} is not the CPU"
        if dtype != torch.float32:
            return f"dtype {dtype} is not float32"
        if block_size <= 0:
            return f"block_size {block_size} is not positive"
        ext = _extension()
        return ext if isinstance(ext, str) else None

    def build_state(self, meta: AttentionMetadata) -> CpuPagedState:
        groups = super().build_state(meta).groups
        decode = None
        for g in groups:
            if g.plan.max_q == 1:  # at most one group: every decode row of the step
                num_rows = meta.num_tokens if g.tokens is None else int(g.tokens.shape[0])
                decode = DecodeKernelArgs(
                    g.block_table.to(torch.int32).contiguous(),
                    g.seq_lens_k.to(torch.int32).contiguous(),
                    torch.arange(num_rows, dtype=torch.int64),
                )
        return CpuPagedState(groups, decode)

    def _attend(
        self,
        g: AttentionGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        state: ReferenceState,
        scale: float,
    ) -> torch.Tensor:
        ext = load_extension()
        args = state.decode if isinstance(state, CpuPagedState) else None
        if g.plan.max_q != 1 or ext is None or args is None:
            return super()._attend(g, q, k_cache, v_cache, state, scale)
        q = q.contiguous()
        out = torch.empty_like(q)
        ext.paged_decode(
            q, k_cache, v_cache, args.block_table, args.seq_lens_k, args.rows, scale, out
        )
        return out
