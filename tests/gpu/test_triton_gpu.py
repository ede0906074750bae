"""The Triton paged-attention backend on a CUDA GPU at serving sizes, against the torch
reference: head_dim 128, 32 query heads over 8 KV heads, contexts of a few thousand tokens,
64 sequences, bfloat16 (plus one float16, one float32 and one head_dim 64 case).

Run on a GPU host: `pytest -m gpu tests/gpu/test_triton_gpu.py`. Skipped without CUDA.
`kernels.triton_paged` is imported inside the tests, not at collection: importing it
decorates the kernels, and on a CPU host `tests/kernels/test_triton_paged.py` must be the
first to do so (under the interpreter).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.kv_write import write_kv
from kernels.reference import TorchReferenceBackend
from tests.kernels.helpers import step_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def usable(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """`cls`, or a skip saying why it cannot run here (bfloat16, these shapes)."""
    reason = cls.why_not(
        device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=HEAD_DIM, block_size=BLOCK
    )
    if reason is not None:
        pytest.skip(reason)
    return cls


@pytest.fixture(scope="module")
def triton_backend():
    from kernels.triton_paged import TritonPagedBackend

    return usable(TritonPagedBackend)


@dataclass
class Step:
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata

    def copy(self) -> Step:
        """Own caches and a metadata object without backend state, for another backend."""
        m = self.meta
        meta = AttentionMetadata(
            m.cu_seqlens_q,
            m.seq_lens_k,
            m.block_table,
            m.slot_mapping,
            m.max_seqlen_q,
            m.max_seqlen_k,
            m.block_size,
        )
        return Step(
            self.q, self.k_new, self.v_new, self.k_cache.clone(), self.v_cache.clone(), meta
        )

    def forward(self, backend: AttentionBackend, scale: float = HEAD_DIM**-0.5) -> torch.Tensor:
        kv = (self.k_cache, self.v_cache)
        return backend.forward(self.q, self.k_new, self.v_new, self.meta, kv_cache=kv, scale=scale)


def make_step(
    shapes: list[tuple[int, int]],
    *,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = BLOCK,
    device: str = "cuda",
    seed: int = 0,
) -> Step:
    """A step over `shapes` (q_len, k_len) per sequence: blocks shuffled across the cache,
    earlier positions cached, this step's K/V not yet written, every other slot huge."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-k_len // block_size) for _, k_len in shapes]
    num_blocks = 2 * sum(blocks) + 1
    order = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    table = torch.zeros(len(shapes), max(blocks), dtype=torch.int32, device=device)
    slots, new_slots, start = [], [], 0
    for i, ((q_len, k_len), nb) in enumerate(zip(shapes, blocks, strict=True)):
        table[i, :nb] = order[start : start + nb]
        start += nb
        pos = torch.arange(k_len, device=device)
        seq_slots = table[i, pos // block_size].long() * block_size + pos % block_size
        slots.append(seq_slots[: max(k_len - q_len, 0)])
        new_slots.append(seq_slots[max(k_len - q_len, 0) :])

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        return (x * scale).to(dtype)

    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = randn(*cache_shape, scale=1e3), randn(*cache_shape, scale=1e3)
    old = torch.cat(slots)
    k_old, v_old = randn(len(old), kv_heads, head_dim), randn(len(old), kv_heads, head_dim)
    write_kv(k_old, v_old, k_cache, v_cache, old)
    num_tokens = sum(q for q, _ in shapes)
    meta = step_metadata(shapes, table, torch.cat(new_slots), block_size, device)
    return Step(
        randn(num_tokens, heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        randn(num_tokens, kv_heads, head_dim),
        k_cache,
        v_cache,
        meta,
    )


def decodes(n: int, lo: int = 1000, hi: int = 4000, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(1, rng.randint(lo, hi)) for _ in range(n)]


def mixed_64(seed: int = 0) -> list[tuple[int, int]]:
    """8 prefill chunks over cached prefixes, 8 whole prompts, 40 decodes, 8 verifications."""
    rng = random.Random(seed)
    chunks = [(256, rng.randint(1000, 3000) + 256) for _ in range(8)]
    prompts = [(n, n) for n in (rng.randint(300, 700) for _ in range(8))]
    verify = [(4, rng.randint(500, 3000)) for _ in range(8)]
    steps = chunks + prompts + decodes(40, seed=seed) + verify
    rng.shuffle(steps)
    return steps


def parity(backend: AttentionBackend, step: Step, **tol: float) -> torch.Tensor:
    """The backend's output, after checking it and its cache writes against the reference."""
    ours, ref = step.copy(), step.copy()
    got = ours.forward(backend)
    want = ref.forward(TorchReferenceBackend())
    assert got.dtype == step.q.dtype and torch.isfinite(got).all()
    assert torch.equal(ours.k_cache, ref.k_cache) and torch.equal(ours.v_cache, ref.v_cache)
    torch.testing.assert_close(got, want, **(tol or BF16_TOL))
    return got


def test_decode_batch(triton_backend):
    parity(triton_backend(), make_step(decodes(64)))


def test_mixed_batch(triton_backend):
    parity(triton_backend(), make_step(mixed_64()))


def test_split_kv_agrees_with_unified_and_reference(triton_backend):
    from kernels.triton_paged import TritonTuning

    step = make_step(decodes(8, 3000, 4000, seed=1))
    split = triton_backend()
    ours = step.copy()
    got = ours.forward(split)
    (plan, _), *_ = ours.meta.state.launches.values()
    assert plan.num_splits > 1  # 8 sequences x 8 KV heads: the rule splits
    unified = parity(triton_backend(TritonTuning(num_splits=1)), step)
    torch.testing.assert_close(got, unified, **BF16_TOL)
    parity(split, step)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "tol"),
    [
        (torch.float16, 128, dict(atol=5e-3, rtol=5e-3)),
        (torch.float32, 128, dict(atol=1e-4, rtol=1e-4)),  # IEEE dots, not TF32
        (torch.bfloat16, 64, BF16_TOL),
    ],
)
def test_other_dtypes_and_head_dims(triton_backend, dtype, head_dim, tol):
    step = make_step(mixed_64(seed=2)[:16], dtype=dtype, head_dim=head_dim)
    parity(triton_backend(), step, **tol)


@pytest.mark.parametrize("num_seqs", [8, 64])  # split in 4 / not split
def test_launch_replays_in_a_cuda_graph_with_new_lengths(triton_backend, num_seqs):
    """The grid and every argument depend on shapes only: a captured decode step replays
    correctly after its sequences' lengths change in place."""
    step = make_step(decodes(num_seqs, 2000, 4000, seed=3))
    ours = step.copy()
    backend = triton_backend()
    kv = (ours.k_cache, ours.v_cache)
    backend.write_kv(step.k_new, step.v_new, kv, ours.meta)
    state = backend.prepare(ours.meta)
    out = torch.empty_like(step.q)
    scale = HEAD_DIM**-0.5
    backend.attend(step.q, kv, ours.meta, state, scale=scale, out=out)  # compile, plan, scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.attend(step.q, kv, ours.meta, state, scale=scale, out=out)
    # The same sequences, shorter: keep each one's first keys and blocks.
    lens = ours.meta.seq_lens_k
    shorter = torch.randint(1, 2000, lens.shape, device="cuda", dtype=lens.dtype)
    lens.copy_(torch.minimum(lens, shorter))
    graph.replay()
    ref = TorchReferenceBackend()
    meta = ours.meta
    ref_meta = AttentionMetadata(
        meta.cu_seqlens_q, lens, meta.block_table, meta.slot_mapping, 1, int(lens.max()), BLOCK
    )
    want = ref.attend(step.q, kv, ref_meta, ref.prepare(ref_meta), scale=scale)
    torch.testing.assert_close(out, want, **BF16_TOL)


def test_new_batch_sizes_and_table_widths_compile_nothing(triton_backend):
    """The sequence count and the block table's width change every step: left unspecialised
    (Triton would compile variants for 1 and for multiples of 16), steps of 1, 16 and 17
    sequences with tables 1 to 250 blocks wide share one compiled kernel (a compile in the
    middle of serving costs up to a second)."""
    from kernels.triton import attention
    from kernels.triton_paged import TritonTuning

    backend = triton_backend()
    backend.tuning = TritonTuning(num_splits=1)  # the split count is a constant by design
    compiled = attention.paged_attention_kernel.device_caches[torch.cuda.current_device()][0]
    step = make_step(decodes(4, 100, 300, seed=1))
    step.copy().forward(backend)
    before = len(compiled)
    for n, hi in ((1, 15), (16, 4000), (17, 4000)):
        step = make_step(decodes(n, 1, hi, seed=n))
        step.copy().forward(backend)
    torch.cuda.synchronize()
    assert len(compiled) == before
