"""Compile the kernels for a GPU that is not here and read their resource use.

The triton wheel ships ptxas and cuobjdump, so the launches `kernels.triton_paged` makes can
be compiled for sm_90 on a CPU-only host: this catches what the interpreter cannot (code that
does not lower, register spills). Needs `TRITON_INTERPRET` unset (interpreted kernels cannot
be compiled). `python -m kernels.triton.compile_check` prints one line per launch;
`--json` prints them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton import attention, fused, kv_write, split_kv
from kernels.triton_paged import TritonTuning, plan_launch

_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@dataclass(frozen=True, slots=True)
class Usage:
    name: str
    registers: int
    stack_bytes: int  # > 0: registers spilled to local memory
    shared_bytes: int


def _compile(fn, types: dict[str, str], constants: dict, *, name: str, arch: int, **options):
    signature = {arg: types.get(arg, "constexpr") for arg in fn.arg_names}
    src = ASTSource(fn, signature, constexprs=constants)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = subprocess.run(
            [str(_CUOBJDUMP), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", dump)
    assert found, dump
    return Usage(name, int(found.group(1)), int(found.group(2)), kernel.metadata.shared)


def attention_usage(
    *,
    dtype: str,
    head_dim: int,
    group: int,
    block_m: int,
    tile_n: int,
    num_splits: int,
    num_warps: int,
    num_stages: int = 2,
    block_size: int = 16,
    arch: int = 90,
) -> Usage:
    """`dtype` in triton's spelling (bf16, fp16, fp32)."""
    ptr, f32 = f"*{dtype}", "*fp32" if num_splits > 1 else f"*{dtype}"
    types = dict(
        q=ptr, k_cache=ptr, v_cache=ptr, out=ptr, cu_seqlens_q="*i32", seq_lens_k="*i32",
        block_table="*i32", part_acc=f32, part_max=f32, part_sum=f32, num_seqs="i32",
        num_heads="i32", qk_scale="fp32",
    )  # fmt: skip
    for stride in ("qt", "qh", "ot", "oh", "kb", "ks", "kh", "vb", "vs", "vh", "bt_row"):
        types[f"stride_{stride}"] = "i32"
    constants = dict(
        stride_bt_col=1, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", WIDE_OFFSETS=False,
    )  # fmt: skip
    name = (
        f"attention {dtype} d={head_dim} group={group} rows={block_m} keys={tile_n} "
        f"splits={num_splits} warps={num_warps}"
    )
    return _compile(
        attention.paged_attention_kernel, types, constants, name=name, arch=arch,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def combine_usage(*, dtype: str, head_dim: int, num_splits: int, arch: int = 90) -> Usage:
    types = dict(part_acc="*fp32", part_max="*fp32", part_sum="*fp32", out=f"*{dtype}",
                 num_heads="i32", stride_ot="i32", stride_oh="i32")  # fmt: skip
    splits_pad = max(2, triton.next_power_of_2(num_splits))
    constants = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                     NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad)  # fmt: skip
    name = f"combine {dtype} d={head_dim} splits={num_splits}"
    return _compile(split_kv.combine_splits_kernel, types, constants, name=name, arch=arch)


def kv_write_usage(*, dtype: str, kv_heads: int, head_dim: int, arch: int = 90) -> Usage:
    types = {name: f"*{dtype}" for name in ("k", "v", "k_cache", "v_cache")}
    types["slot_mapping"] = "*i64"
    for stride in ("kt", "kh", "vt", "vh", "kcb", "kcs", "kch", "vcb", "vcs", "vch"):
        types[f"stride_{stride}"] = "i32"
    constants = dict(KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads),
                     HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
                     BLOCK_SIZE=16)  # fmt: skip
    name = f"kv_write {dtype} kv_heads={kv_heads} d={head_dim}"
    return _compile(kv_write.write_kv_kernel, types, constants, name=name, arch=arch)


def fused_usages(*, dtype: str, hidden: int, intermediate: int, heads: int, kv_heads: int,
                 head_dim: int, arch: int = 90) -> list[Usage]:  # fmt: skip
    """The layer kernels of kernels.triton.fused for one model shape, launched as
    `kernels.triton.fused` launches them."""
    ptr = f"*{dtype}"
    norm_block = triton.next_power_of_2(hidden)
    norm = _compile(
        fused.add_rms_norm_kernel,
        dict(x=ptr, residual=ptr, weight=ptr, out=ptr, stride_x="i32", stride_r="i32",
             stride_o="i32", eps="fp32"),
        dict(HIDDEN=hidden, BLOCK=norm_block, HAS_RESIDUAL=True, SCALE_IN_DTYPE=dtype != "fp32"),
        name=f"add_rms_norm {dtype} hidden={hidden}", arch=arch,
        num_warps=fused._warps(norm_block),
    )  # fmt: skip
    rope_heads = heads + kv_heads
    half = head_dim // 2
    rope_elements = triton.next_power_of_2(rope_heads) * triton.next_power_of_2(half)
    rope = _compile(
        fused.rope_kernel,
        dict(x=ptr, cos=ptr, sin=ptr, stride_xt="i32", stride_xh="i32", stride_ct="i32",
             stride_st="i32"),
        dict(HEADS=rope_heads, HEADS_PAD=triton.next_power_of_2(rope_heads), HALF=half,
             HALF_PAD=triton.next_power_of_2(half)),
        name=f"rope {dtype} heads={rope_heads} d={head_dim}", arch=arch,
        num_warps=fused._warps(rope_elements),
    )  # fmt: skip
    heads_pad, kv_pad = triton.next_power_of_2(heads), triton.next_power_of_2(kv_heads)
    rope_writes = [
        _compile(
            fused.rope_write_kv_kernel,
            dict(q=ptr, k=ptr, v=ptr, cos=ptr, sin=ptr, k_cache=ptr, v_cache=ptr,
                 slot_mapping="*i64", q_norm=ptr, k_norm=ptr, eps="fp32",
                 **{f"stride_{s}": "i32" for s in ("qt", "qh", "kt", "kh", "vt", "vh", "ct",
                                                   "st", "kcb", "kcs", "kch", "vcb", "vcs",
                                                   "vch")}),
            dict(HEADS=heads, HEADS_PAD=heads_pad, KV_HEADS=kv_heads, KV_PAD=kv_pad, HALF=half,
                 HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=16, NORM=qk_norm,
                 SCALE_IN_DTYPE=dtype != "fp32"),
            name=f"rope_write_kv{'_qk_norm' if qk_norm else ''} {dtype} heads={heads}/{kv_heads} "
                 f"d={head_dim}",
            arch=arch, num_warps=fused._warps(heads_pad * triton.next_power_of_2(half)),
        )
        for qk_norm in (False, True)  # Llama; Qwen3's q/k norms
    ]  # fmt: skip
    silu = _compile(
        fused.silu_mul_kernel,
        dict(gate_up=ptr, out=ptr, stride_g="i32", stride_o="i32"),
        dict(SIZE=intermediate, BLOCK=min(fused.SILU_BLOCK, triton.next_power_of_2(intermediate))),
        name=f"silu_mul {dtype} size={intermediate}", arch=arch, num_warps=4,
    )  # fmt: skip
    return [norm, rope, *rope_writes, silu]


# (dtype, heads, kv_heads, head_dim, num_seqs, max_seqlen_q, max_seqlen_k): Llama-3-8B-like
# decode (plain and split), verification and prefill; no GQA; a wide group; head_dim 64.
STEPS = [
    ("bf16", 32, 8, 128, 64, 1, 4096),
    ("bf16", 32, 8, 128, 4, 1, 4096),
    ("bf16", 32, 8, 128, 16, 4, 4096),
    ("bf16", 32, 8, 128, 8, 2048, 4096),
    ("bf16", 32, 32, 128, 8, 2048, 4096),
    ("bf16", 64, 8, 128, 64, 1, 4096),
    ("bf16", 32, 8, 64, 8, 2048, 4096),
    ("fp16", 32, 8, 128, 8, 2048, 4096),
]


def backend_launches(arch: int = 90) -> list[Usage]:
    """Resource use of what the backend launches for `STEPS` with its default tuning, on an
    H100-sized device (264 target programs)."""
    tuning = TritonTuning()
    usages = []
    for dtype, heads, kv_heads, head_dim, seqs, max_q, max_k in STEPS:
        plan = plan_launch(
            num_seqs=seqs, num_heads=heads, kv_heads=kv_heads, max_seqlen_q=max_q,
            max_seqlen_k=max_k, tuning=tuning, target_programs=264,
        )  # fmt: skip
        usage = attention_usage(
            dtype=dtype, head_dim=head_dim, group=heads // kv_heads, block_m=plan.block_m,
            tile_n=tuning.tile_n, num_splits=plan.num_splits, num_warps=plan.num_warps,
            num_stages=tuning.num_stages, arch=arch,
        )  # fmt: skip
        usages.append(usage)
        if plan.num_splits > 1:
            usages.append(combine_usage(dtype=dtype, head_dim=head_dim, num_splits=plan.num_splits))
    usages.append(kv_write_usage(dtype="bf16", kv_heads=8, head_dim=128, arch=arch))
    # Llama-3.2-1B and Llama-3.1-8B shapes (kernels.layer_ops)
    usages += fused_usages(dtype="bf16", hidden=2048, intermediate=8192, heads=32, kv_heads=8,
                           head_dim=64, arch=arch)  # fmt: skip
    usages += fused_usages(dtype="bf16", hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                           head_dim=128, arch=arch)  # fmt: skip
    return usages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    usages = backend_launches(args.arch)
    if args.json:
        print(json.dumps([dataclasses.asdict(u) for u in usages]))
        return
    for u in usages:
        print(f"{u.name}: {u.registers} regs, {u.stack_bytes} B stack, {u.shared_bytes} B smem")


if __name__ == "__main__":
    main()
