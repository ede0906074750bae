"""Paged attention with our own Triton kernels: one launch per layer for a whole mixed step.

Prefill chunks (with or without a cached prefix), single-token decodes and short
verifications of speculative drafts run together through `kernels.triton.attention`: varlen
query tiles found from `cu_seqlens_q`, keys gathered through the block table in tiles that do
not depend on the cache's block size, the query heads of one KV head packed into one program.
The K/V write is `kernels.triton.kv_write`. Nothing here reads a device tensor back to the
host: launch shapes come from tensor shapes and from `max_seqlen_q` / `max_seqlen_k`.

The launch, decided once per step and attention shape (`plan_launch`):

* query rows per program `block_m = clamp(next_pow2(max_seqlen_q * group), 16, max_block_m)`
  (at least the group): decodes get 16-row programs, prefill chunks `max_block_m` rows; 4
  warps up to 32 rows, else 8; key tiles of 32 (on sm_90, 64-key tiles of head_dim 128 spill
  registers: see `kernels.triton.compile_check`);
* split-KV (flash decoding) when every sequence's queries fit in one query tile (decodes and
  short verifications) and the step has fewer (sequence, kv head) programs than
  `target_programs` (default twice the device's SM count): the keys are split in
  `min(max_splits, target_programs // programs, max_seqlen_k // split_min_keys)` runs,
  rounded down to a power of two (the longest sequence's splits get `split_min_keys` keys or
  more; a shorter one's runs are shorter, some empty); one split means the plain launch.
  Any split count is correct for any lengths (each program splits its own keys), so a CUDA
  graph may freeze the count it was captured with; only speed depends on it.

Where it runs: CUDA (compute capability 8.0+), float16 / bfloat16 / float32 (float32 dots in
IEEE precision, not TF32), head_dim a multiple of 16 up to 128, any block size. On CPU only
under Triton's interpreter, for tests: `TRITON_INTERPRET=1` must be set now and must have
been set when the kernels were imported, as when triton itself was first imported (a
`@triton.jit` function keeps the mode it was decorated in); float16 and float32 only (the
interpreter computes bfloat16 dots on raw bits). Without triton the module still imports
and `why_not` says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kernels.graph_metadata import StaticDecodeMetadata
from kernels.interface import AttentionMetadata, BackendState, KVCache
from kernels.registry import register_backend

try:
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.triton import attention, kv_write, split_kv
except ImportError as exc:  # the CPU CI has no triton: the backend stays registered, unusable
    TRITON_MISSING: str | None = f"triton is not importable ({exc})"
else:
    TRITON_MISSING = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
CPU_TARGET_PROGRAMS = 2 * 132  # the interpreter plans as an H100 would


@dataclass(frozen=True, slots=True)
class TritonTuning:
    """Tile sizes and the split rule. Defaults are first guesses for an H100, to tune there."""

    max_block_m: int = 64  # query rows (tokens x group heads) per program, long queries
    tile_n: int = 32  # keys per tile; any power of two >= 16, whatever the block size
    split_min_keys: int = 512  # fewest keys per split of the step's longest sequence
    max_splits: int = 16
    target_programs: int | None = None  # None: twice the device's SM count
    num_splits: int | None = None  # force a split count (tests, benchmarks); None: the rule
    num_warps: int | None = None  # None: 4 for up to 32 query rows, else 8
    num_stages: int = 2


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    block_m: int  # query rows per program
    block_q: int  # query tokens per program: block_m // group
    num_splits: int
    num_warps: int


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_launch(
    *,
    num_seqs: int,
    num_heads: int,
    kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    tuning: TritonTuning,
    target_programs: int,
) -> LaunchPlan:
    """The tile sizes and split count for a step (the rule in the module docstring)."""
    group = num_heads // kv_heads
    block_m = max(16, min(_next_pow2(max_seqlen_q * group), tuning.max_block_m))
    block_m = max(block_m, _next_pow2(group))
    block_q = block_m // group
    warps = tuning.num_warps or (4 if block_m <= 32 else 8)
    if tuning.num_splits is not None:
        return LaunchPlan(block_m, block_q, tuning.num_splits, warps)
    programs = num_seqs * kv_heads
    splits = 1
    if max_seqlen_q <= block_q and 0 < programs < target_programs:
        splits = min(
            tuning.max_splits, target_programs // programs, max_seqlen_k // tuning.split_min_keys
        )
    # a power of two: the count is a kernel constant, so each distinct one is a compile (up
    # to a second on the first step that needs it); five, not sixteen, can occur
    splits = 1 << (max(splits, 1).bit_length() - 1)
    return LaunchPlan(block_m, block_q, splits, warps)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def interpreted() -> bool:
    """Whether the kernels were decorated for Triton's interpreter (CPU tensors)."""
    return TRITON_MISSING is None and isinstance(
        attention.paged_attention_kernel, InterpretedFunction
    )


def _mixed_modes() -> bool:
    """Our kernels and triton's own library functions (decorated when triton was first
    imported) disagree about the interpreter: no kernel can run."""
    return interpreted() != isinstance(triton.language.standard.cdiv, InterpretedFunction)


@dataclass(slots=True)
class TritonState(BackendState):
    """Per step, for each attention shape `(num_heads, kv_heads, head_dim)` seen (one in a
    plain model): its launch plan and, when split, the float32 scratch every layer reuses
    (layers run one after another on one stream)."""

    launches: dict[tuple[int, int, int], tuple[LaunchPlan, split_kv.SplitScratch | None]] = field(
        default_factory=dict
    )


@register_backend(priority=50)
class TritonPagedBackend(StaticDecodeMetadata[TritonState]):
    """Paged attention for mixed steps in Triton; see the module docstring for the rules.
    Its launches depend on shapes only, so decode steps run in CUDA graphs over static
    metadata (`StaticDecodeMetadata`)."""

    name = "triton_paged"
    state_type: type[TritonState] = TritonState

    def __init__(self, tuning: TritonTuning | None = None):
        self.tuning = tuning or TritonTuning()

    @classmethod
    def why_not(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> str | None:
        if TRITON_MISSING is not None:
            return TRITON_MISSING
        if _mixed_modes():
            return "TRITON_INTERPRET changed between importing triton and kernels.triton"
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if interpreted():
                return "the Triton kernels were built for the interpreter (TRITON_INTERPRET=1)"
            if torch.cuda.get_device_capability(device) < (8, 0):
                return "the GPU is older than compute capability 8.0 (untested there)"
        elif device.type == "cpu":
            if not (triton.knobs.runtime.interpret and interpreted()):
                return "device cpu is not CUDA (Triton runs on CPU only under TRITON_INTERPRET=1)"
        else:
            return f"device {device} is not CUDA"
        if dtype not in DTYPES:
            return f"dtype {dtype} is not float16, bfloat16 or float32"
        if device.type == "cpu" and dtype == torch.bfloat16:
            # it keeps bfloat16 as raw uint16 bits and tl.dot multiplies those
            return "Triton's interpreter does not support bfloat16"
        if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} is not a multiple of 16 in [16, {MAX_HEAD_DIM}]"
        if block_size <= 0:
            return f"block_size {block_size} is not positive"
        return None

    def build_state(self, meta: AttentionMetadata) -> TritonState:
        return TritonState()  # filled by the first layer's `attend`, from shapes only

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> None:
        kv_write.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        state: TritonState,
        *,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        _, num_heads, head_dim = q.shape
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        key = (num_heads, k_cache.shape[2], head_dim)
        launch = state.launches.get(key)
        if launch is None:
            launch = state.launches[key] = self._plan(q, k_cache, meta)
        plan, scratch = launch
        attention.paged_attention(
            q,
            k_cache,
            v_cache,
            out,
            meta.cu_seqlens_q,
            meta.seq_lens_k,
            meta.block_table,
            scale=scale,
            block_m=plan.block_m,
            tile_n=self.tuning.tile_n,
            num_splits=plan.num_splits,
            scratch=scratch,
            num_warps=plan.num_warps,
            num_stages=self.tuning.num_stages,
        )
        return out

    def _plan(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[LaunchPlan, split_kv.SplitScratch | None]:
        num_tokens, num_heads, head_dim = q.shape
        target = self.tuning.target_programs
        if target is None:
            target = (
                2 * _sm_count(q.device.index or 0)
                if q.device.type == "cuda"
                else CPU_TARGET_PROGRAMS
            )
        plan = plan_launch(
            num_seqs=meta.num_seqs,
            num_heads=num_heads,
            kv_heads=k_cache.shape[2],
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            tuning=self.tuning,
            target_programs=target,
        )
        scratch = None
        if plan.num_splits > 1:
            scratch = split_kv.SplitScratch.allocate(
                num_tokens, num_heads, head_dim, plan.num_splits, q.device
            )
        return plan, scratch
