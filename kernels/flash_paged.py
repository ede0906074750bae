"""Paged attention through a FlashAttention build: vLLM's `vllm_flash_attn` (the mission's
package, also shipped inside vLLM as `vllm.vllm_flash_attn`), flash-attn-4 (`flash_attn.cute`,
the CuTe DSL kernels for Hopper and Blackwell) or Dao-AILab's `flash_attn` 2, first found first.

All take this package's cache layout as it is (`[num_blocks, block_size, kv_heads,
head_dim]`, last dim contiguous), a step's packed queries with `cu_seqlens_q`, and the block
table; they run a whole mixed prefill/decode step in one varlen launch per layer, with GQA
native and the causal mask aligned bottom-right, as the contract says. They differ in how the
key lengths come in: `vllm_flash_attn` reads `seqused_k` (our `seq_lens_k`) and any block
size divisible by 16; flash-attn-4 reads `seqused_k` too, its block table as `page_table`,
and returns its output (copied into ours); `flash_attn` 2 takes `cu_seqlens_k`, which this
backend builds once per step on the device (a cumsum, no host read), and pages of a multiple
of 256 tokens only.

Whether the backend serves here (`why_not`): a CUDA device, float16 or bfloat16, head_dim a
multiple of 8 up to 256, a build that imports and accepts the block size, and a start-up
smoke check: one small mixed paged step on this GPU against the torch reference. A build that
imports but raises or computes something else is passed over, and the registry logs why.

CUDA graphs: the kernels read lengths and tables from tensors, and `max_seqlen_k` only sizes
their split heuristic, so decode steps replay over static metadata (`StaticDecodeMetadata`);
for `flash_attn` 2 a replay rebuilds the static `cu_seqlens_k` from the copied lengths.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.graph_metadata import StaticDecodeMetadata
from kernels.interface import AttentionMetadata, BackendState, KVCache
from kernels.registry import register_backend

try:  # the K/V write that honours a graph bucket's padding slots (-1)
    from kernels.triton import kv_write as triton_kv_write
except ImportError:
    triton_kv_write = None  # type: ignore[assignment]

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class FlashBuild:
    """An importable FlashAttention: its varlen entry point and how it takes key lengths."""

    module: str
    varlen: Callable[..., Any]
    seqused_k: bool  # True: takes `seqused_k`; False: needs `cu_seqlens_k`
    page_multiple: int  # a paged cache's block size must be a multiple of this
    options: tuple[tuple[str, Any], ...] = ()  # extra keywords of every call
    table_keyword: str = "block_table"  # how a `seqused_k` build names the block table
    writes_out: bool = True  # a `seqused_k` build that fills `out=`; else it returns it


def _version_options(mod: Any) -> tuple[tuple[str, Any], ...]:
    """vLLM's build runs FA2 by default; FA3 where it says this GPU supports it (Hopper)."""
    supported = getattr(mod, "is_fa_version_supported", None)
    try:
        return (("fa_version", 3),) if supported is not None and supported(3) else ()
    except Exception:
        return ()


@functools.cache
def find_build() -> FlashBuild | str:
    """The first FlashAttention build that imports, or why none does."""
    tried = []
    for module, seqused_k, page in (
        ("vllm_flash_attn", True, 16),
        ("vllm.vllm_flash_attn", True, 16),
        ("flash_attn.cute", True, 16),  # flash-attn-4
        ("flash_attn", False, 256),
    ):
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            tried.append(f"{module}: not installed")
            continue
        try:
            mod = importlib.import_module(module)
            varlen = mod.flash_attn_varlen_func
        except Exception as exc:  # an ABI mismatch raises ImportError, OSError, ...
            tried.append(f"{module}: {type(exc).__name__}: {exc}")
            continue
        if module == "flash_attn.cute":
            return FlashBuild(module, varlen, True, page, (), "page_table", writes_out=False)
        options = _version_options(mod) if seqused_k else ()
        return FlashBuild(module, varlen, seqused_k, page, options)
    return "no FlashAttention build imports (" + "; ".join(tried) + ")"


@dataclass(slots=True)
class FlashState(BackendState):
    """`cu_seqlens_k` (`[B + 1]` int32) for builds that take it; None for `seqused_k`."""

    cu_seqlens_k: torch.Tensor | None


def _cu_seqlens_k(seq_lens_k: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.zeros(seq_lens_k.shape[0] + 1, dtype=torch.int32, device=seq_lens_k.device)
    torch.cumsum(seq_lens_k, 0, dtype=torch.int32, out=out[1:])
    return out


@register_backend(priority=60)
class FlashPagedBackend(StaticDecodeMetadata[FlashState]):
    """Paged attention through FlashAttention's varlen kernels (see the module docstring)."""

    name = "flash_attn"
    state_type: type[FlashState] = FlashState

    def __init__(self, build: FlashBuild | None = None):
        found = build or find_build()
        if isinstance(found, str):
            raise RuntimeError(found)
        self.build = found
        self._options = dict(found.options)
        # flash_attn 2 graphs: one cu_seqlens_k per bucket, rebuilt at each replay
        self._captured_states: dict[int, FlashState] = {}

    @classmethod
    def why_not(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> str | None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"device {device} is not an available CUDA device"
        if dtype not in DTYPES:
            return f"dtype {dtype} is not float16 or bfloat16"
        if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} is not a multiple of 8 in [8, {MAX_HEAD_DIM}]"
        if triton_kv_write is None:
            return "triton is not importable (the K/V write of captured decode steps needs it)"
        build = find_build()
        if isinstance(build, str):
            return build
        if block_size % build.page_multiple:
            return f"{build.module} pages KV by {build.page_multiple} tokens, not {block_size}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        return smoke_check(index, dtype, head_dim, block_size)

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> None:
        """On CUDA, the Triton write, which skips a graph bucket's padding rows (slot -1):
        the default `index_copy_` would take -1 as an out-of-range index, a device-side
        assert that ends the CUDA context. (On the CPU, where the adapter's tests run a
        stand-in build, the default.)"""
        if k.is_cuda and triton_kv_write is not None:
            triton_kv_write.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        else:
            super().write_kv(k, v, kv_cache, meta)

    def build_state(self, meta: AttentionMetadata) -> FlashState:
        if self.build.seqused_k:
            return FlashState(None)
        return FlashState(_cu_seqlens_k(meta.seq_lens_k))

    def prepare_for_replay(self, bs: int, meta: AttentionMetadata) -> None:
        super().prepare_for_replay(bs, meta)
        state = self._captured_states.get(bs)
        if state is not None and state.cu_seqlens_k is not None:
            static = self._static
            assert static is not None
            _cu_seqlens_k(static["seq_lens_k"][:bs], state.cu_seqlens_k)

    def prepare_for_capture(self, bs: int, max_seqlen_k: int) -> AttentionMetadata:
        meta = super().prepare_for_capture(bs, max_seqlen_k)
        assert isinstance(meta.state, FlashState)
        # every graph of bucket `bs` reads the same static lengths, so one cu_seqlens_k each
        captured = self._captured_states.setdefault(bs, meta.state)
        meta.state = captured
        return meta

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        state: FlashState,
        *,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if out is None:
            out = torch.empty_like(q)
        build = self.build
        if state.cu_seqlens_k is None:
            options = {build.table_keyword: meta.block_table, **self._options}
            if build.writes_out:
                options["out"] = out
            result = build.varlen(
                q=q, k=k_cache, v=v_cache,
                cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                seqused_k=meta.seq_lens_k, max_seqlen_k=meta.max_seqlen_k,
                softmax_scale=scale, causal=True, **options,
            )  # fmt: skip
            if not build.writes_out:  # flash-attn-4: (out, lse) or out
                out.copy_(result[0] if isinstance(result, tuple) else result)
            return out
        result = build.varlen(
            q, k_cache, v_cache, meta.cu_seqlens_q, state.cu_seqlens_k,
            meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=meta.block_table,
        )  # fmt: skip
        out.copy_(result)
        return out


@functools.cache
def smoke_check(
    device_index: int, dtype: torch.dtype, head_dim: int, block_size: int
) -> str | None:
    """None when the build computes one small mixed paged step (a prefill chunk over a cached
    prefix, a decode, a whole prompt; GQA 2) like the torch reference on this GPU; else why."""
    from kernels.reference import TorchReferenceBackend

    device = torch.device("cuda", device_index)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q_lens, k_lens = [5, 1, 7], [37, 20, 7]
    heads, kv_heads = 4, 2
    blocks_per_seq = -(-max(k_lens) // block_size)
    num_blocks = len(q_lens) * blocks_per_seq + 1
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # shuffled, block 0 unused
    table = order.view(len(q_lens), blocks_per_seq).to(torch.int32)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    q = rand(sum(q_lens), heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu.to(device),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
        block_size=block_size,
    )
    scale = head_dim**-0.5
    try:
        ours = FlashPagedBackend()
        got = ours.attend(q, (k_cache, v_cache), meta, ours.build_state(meta), scale=scale)
        ref = TorchReferenceBackend()
        want = ref.attend(q, (k_cache, v_cache), meta, ref.build_state(meta), scale=scale)
        torch.cuda.synchronize(device)
    except Exception as exc:
        return f"the smoke check raised {type(exc).__name__}: {exc}"
    error = (got.float() - want.float()).abs().max().item()
    if not error <= 2e-2:
        return f"the smoke check differs from the torch reference by {error:.3g}"
    return None
