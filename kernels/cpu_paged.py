"""CPU paged attention: a small C++ kernel for decode and short queries, the torch reference for
the rest.

Decode dominates serving, and on CPU the torch reference spends most of a decode step copying
K/V: it gathers every sequence's blocks into a padded tensor, then the batched matmuls copy
the strided views again. `csrc/cpu_paged_decode.cpp` reads K/V in place from the paged cache
(no gather, no padding), parallel over (sequence, kv head), sharing each K/V read across the
GQA group. A short multi-token query (up to `SHORT_QUERY` tokens: a decode with speculative
drafts to verify, a prefill tail) runs through the same kernel as one decode row per query
token, each seeing the keys up to its own position (causal by construction), so verifying `k`
drafts costs about `k + 1` decode rows instead of an SDPA call over gathered, padded K/V.
Longer queries (prefill chunks) keep the reference's SDPA path.

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
from kernels.reference import AttentionGroup, Plan, ReferenceState, TorchReferenceBackend
from kernels.registry import register_backend

log = logging.getLogger("firstlight.kernels")

_SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_decode.cpp"
SHORT_QUERY = 16  # query lengths up to this run as decode rows through the kernel
_NO_BLOCKS = torch.empty(0, dtype=torch.int64)  # a kernel group's plan gathers nothing


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
    """A group's metadata as the C++ kernel takes it, one row per query token, converted once
    per step."""

    block_table: torch.Tensor  # [R, max_blocks] int32, contiguous: the row's sequence's table
    seq_lens_k: torch.Tensor  # [R] int32: keys the row sees (its position + 1)
    rows: torch.Tensor  # [R] int64: the row's index among the group's packed query rows


def kernel_args(g: AttentionGroup, num_rows: int) -> DecodeKernelArgs:
    """Kernel arguments for a group of queries of at most `SHORT_QUERY` tokens."""
    plan = g.plan
    lens_q = None
    if plan.max_q > 1:
        if plan.q_index is None:  # every sequence has max_q queries
            lens_q = torch.full((plan.num_seqs,), plan.max_q, dtype=torch.int64)
        else:
            lens_q = torch.bincount(plan.q_index // plan.max_q, minlength=plan.num_seqs)
    return _rows_args(g.block_table, g.seq_lens_k, lens_q, num_rows)


def _rows_args(
    table: torch.Tensor, lens_k: torch.Tensor, lens_q: torch.Tensor | None, num_rows: int
) -> DecodeKernelArgs:
    """Query token `r` of a sequence with `n` queries and `L` keys becomes a kernel row that
    sees `L - n + 1 + r` keys (`lens_q` None: one query per sequence)."""
    if lens_q is not None:
        device = lens_k.device
        lens_q = lens_q.to(device=device, dtype=torch.int64)
        seq_of_row = torch.repeat_interleave(
            torch.arange(lens_q.shape[0], device=device), lens_q, output_size=num_rows
        )
        first_row = (lens_q.cumsum(0) - lens_q)[seq_of_row]
        r = torch.arange(num_rows, device=device) - first_row
        table = table.index_select(0, seq_of_row)
        lens_k = lens_k.long()[seq_of_row] - (lens_q[seq_of_row] - 1 - r)
    return DecodeKernelArgs(
        table.to(torch.int32).contiguous(),
        lens_k.to(torch.int32).contiguous(),
        torch.arange(num_rows, dtype=torch.int64),
    )


@dataclass(slots=True)
class CpuPagedState(ReferenceState):
    """The reference plans plus, per group, the kernel's arguments (None: SDPA's group)."""

    kernel: list[DecodeKernelArgs | None]


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
        if meta.max_seqlen_q <= SHORT_QUERY and load_extension() is not None:
            # Every query is short (decode steps, verification): one kernel group for the
            # whole step, and no reference plan (its gather indices and masks go unused).
            num_rows = meta.num_tokens
            lens_q = None
            if meta.max_seqlen_q > 1:
                cu = meta.cu_seqlens_q
                lens_q = cu[1:] - cu[:-1]
            plan = Plan(
                meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k, _NO_BLOCKS, None, None, False
            )
            group = AttentionGroup(plan, None, meta.seq_lens_k, meta.block_table)
            args = _rows_args(meta.block_table, meta.seq_lens_k, lens_q, num_rows)
            return CpuPagedState([group], [args])
        groups = super().build_state(meta).groups
        kernel: list[DecodeKernelArgs | None] = []
        for g in groups:
            if g.plan.max_q > SHORT_QUERY:
                kernel.append(None)
                continue
            num_rows = meta.num_tokens if g.tokens is None else int(g.tokens.shape[0])
            kernel.append(kernel_args(g, num_rows))
        return CpuPagedState(groups, kernel)

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
        args = None
        if isinstance(state, CpuPagedState):
            args = next(
                (a for grp, a in zip(state.groups, state.kernel, strict=True) if grp is g), None
            )
        if ext is None or args is None:
            return super()._attend(g, q, k_cache, v_cache, state, scale)
        q = q.contiguous()
        out = torch.empty_like(q)
        ext.paged_decode(
            q, k_cache, v_cache, args.block_table, args.seq_lens_k, args.rows, scale, out
        )
        return out
