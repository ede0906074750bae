"""The Triton paged-attention backend against the torch reference, on tiny shapes.

Without CUDA the kernels run on CPU tensors through Triton's interpreter. `TRITON_INTERPRET=1`
must be set when triton is first imported (triton's own `@jit` library functions are
decorated then), when our kernels are imported, and while they launch (triton imports part of
itself lazily at the first launch). So this module sets it while it imports triton and
`kernels.triton_paged` (`helpers.triton_kernel_device`; test modules are imported before any
test runs, so this is the session's first import of triton) and again around each of its
tests, and restores it otherwise: the registry never picks the interpreter for other modules'
tests. With CUDA the same tests run the compiled kernels on the GPU. Skipped when triton is not
installed.

In a whole-suite run on CPU, something else (transformers' modeling code, imported by the
engine tests) imports triton first, outside the interpreter, and then these kernels cannot
run here: this module is then skipped, and `test_triton_interpreter.py` runs it in a fresh
process of its own.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.kv_write import write_kv
from kernels.reference import TorchReferenceBackend
from kernels.registry import select_backend
from tests.kernels.helpers import (
    PagedCase,
    copy_case,
    dense_attention,
    forward,
    make_case,
    triton_kernel_device,
)

DEVICE = triton_kernel_device()  # imports triton under the interpreter on a CPU host

from kernels.triton import attention  # noqa: E402
from kernels.triton import kv_write as triton_kv_write  # noqa: E402
from kernels.triton_paged import (  # noqa: E402
    LaunchPlan,
    TritonPagedBackend,
    TritonTuning,
    plan_launch,
)


@pytest.fixture(autouse=True)
def interpreter_on(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


LAYOUTS = {
    "decode": [(1, 37), (1, 3), (1, 64), (1, 17)],
    "prefill": [(20, 20), (7, 7), (33, 33)],
    # a prefill chunk over a 32-token cached prefix, decodes, a 3-token verification, a
    # first chunk, a one-token sequence
    "mixed": [(13, 45), (1, 37), (3, 50), (9, 9), (1, 1)],
}
TILE32 = TritonTuning(tile_n=32)  # tiles span two 16-token blocks


def run_both(
    case: PagedCase, tuning: TritonTuning = TILE32, scale: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton, reference) outputs of one layer, each backend on its own copy of the cache."""
    got = forward(TritonPagedBackend(tuning), copy_case(case, DEVICE), scale)
    want = forward(TorchReferenceBackend(), copy_case(case), scale)
    return got.cpu(), want


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_reference(layout: str, group: int, head_dim: int):
    case = make_case(LAYOUTS[layout], num_heads=4, kv_heads=4 // group, head_dim=head_dim)
    assert_close(*run_both(case))


@pytest.mark.parametrize("head_dim", [64, 80])  # 80: padded to 128 lanes in the kernel
def test_larger_head_dims(head_dim: int):
    case = make_case(LAYOUTS["mixed"], num_heads=8, kv_heads=2, head_dim=head_dim, seed=1)
    got, want = run_both(case, scale=head_dim**-0.5)
    assert_close(got, want)
    want_dense = dense_attention(case, head_dim**-0.5)
    torch.testing.assert_close(got.double(), want_dense, atol=2e-5, rtol=1e-5)


def test_float16():
    # bfloat16 only on a GPU (tests/gpu): the interpreter multiplies its raw bits in tl.dot
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=32, dtype=torch.float16)
    got, want = run_both(case)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    ("block_size", "tile_n"),
    [(16, 16), (16, 64), (8, 32), (32, 16), (7, 32)],  # tiles of 1/4/4 blocks, half a block
)
def test_key_tiles_independent_of_block_size(block_size: int, tile_n: int):
    case = make_case(
        LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=16, block_size=block_size, seed=2
    )
    assert_close(*run_both(case, TritonTuning(tile_n=tile_n)))


SPLIT_LAYOUTS = {
    "decode": [(1, 150), (1, 7), (1, 96)],  # (1, 7): one tile, so most splits are empty
    "verify": [(3, 80), (1, 40), (2, 2)],
}


@pytest.mark.parametrize("layout", sorted(SPLIT_LAYOUTS))
def test_split_kv_matches_unified_and_reference(layout: str):
    case = make_case(SPLIT_LAYOUTS[layout], num_heads=8, kv_heads=2, head_dim=32, seed=3)
    want = forward(TorchReferenceBackend(), copy_case(case), 0.2)
    one = TritonPagedBackend(TritonTuning(tile_n=16, num_splits=1))
    unified = forward(one, copy_case(case, DEVICE), 0.2)
    assert_close(unified.cpu(), want)
    for splits in (3, 4):
        backend = TritonPagedBackend(TritonTuning(tile_n=16, num_splits=splits))
        split_case = copy_case(case, DEVICE)
        got = forward(backend, split_case, 0.2)
        (plan, scratch), *_ = split_case.meta.state.launches.values()  # type: ignore[union-attr]
        assert plan.num_splits == splits and scratch is not None
        assert_close(got.cpu(), want)
        torch.testing.assert_close(got, unified, atol=2e-6, rtol=1e-6)


def test_split_rule():
    h100 = dict(num_heads=32, kv_heads=8, tuning=TritonTuning(), target_programs=264)
    # 4 decodes x 8 kv heads = 32 programs on a device that runs 264: split 4 kB contexts in 8
    assert plan_launch(num_seqs=4, max_seqlen_q=1, max_seqlen_k=4096, **h100) == LaunchPlan(
        16, 4, 8, num_warps=4
    )
    assert plan_launch(num_seqs=1, max_seqlen_q=1, max_seqlen_k=32768, **h100).num_splits == 16
    # 64 decodes already give 512 programs; short contexts give a split too few keys
    assert plan_launch(num_seqs=64, max_seqlen_q=1, max_seqlen_k=4096, **h100).num_splits == 1
    assert plan_launch(num_seqs=4, max_seqlen_q=1, max_seqlen_k=700, **h100).num_splits == 1
    # verifying 3 drafts still fits one 4-token query tile; a prefill chunk does not
    assert plan_launch(num_seqs=4, max_seqlen_q=4, max_seqlen_k=4096, **h100).num_splits == 8
    prefill = plan_launch(num_seqs=2, max_seqlen_q=512, max_seqlen_k=4096, **h100)
    assert prefill == LaunchPlan(64, 16, 1, num_warps=8)
    # a group wider than the default 16 rows widens the decode tile
    wide = {**h100, "num_heads": 64, "kv_heads": 2}
    assert plan_launch(num_seqs=64, max_seqlen_q=1, max_seqlen_k=10, **wide).block_m == 32
    # 3 decodes: 264 // 24 = 11 splits by programs, 4096 // 512 = 8 by keys; 5 kB: 10 -> 8;
    # every count a power of two (each distinct count is a compile)
    assert plan_launch(num_seqs=3, max_seqlen_q=1, max_seqlen_k=5120, **h100).num_splits == 8
    counts = {
        plan_launch(num_seqs=n, max_seqlen_q=1, max_seqlen_k=k, **h100).num_splits
        for n in range(1, 40)
        for k in range(1, 20000, 97)
    }
    assert counts == {1, 2, 4, 8, 16}


def test_backend_splits_small_long_decode_batches_by_itself():
    tuning = TritonTuning(tile_n=16, split_min_keys=32, target_programs=16)
    case = make_case(SPLIT_LAYOUTS["decode"], num_heads=4, kv_heads=2, head_dim=16, seed=4)
    triton_case = copy_case(case, DEVICE)
    got = forward(TritonPagedBackend(tuning), triton_case, 0.25)
    (plan, _), *_ = triton_case.meta.state.launches.values()  # type: ignore[union-attr]
    assert plan.num_splits == 2  # 16 // (3 seqs x 2 heads), within 150 // 32
    assert_close(got.cpu(), forward(TorchReferenceBackend(), copy_case(case), 0.25))


def test_writes_into_out_reuses_the_plan_across_layers_and_reads_strided_q():
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=16, seed=5)
    want = forward(TorchReferenceBackend(), copy_case(case), 0.25)
    c = copy_case(case, DEVICE)
    # q as the model passes it: a view into a packed qkv projection
    qkv = torch.randn(c.q.shape[0], 8, 16, device=DEVICE)
    qkv[:, :4] = c.q
    c.q = qkv[:, :4]
    backend = TritonPagedBackend(TritonTuning(tile_n=16, num_splits=2))
    state = backend.prepare(c.meta)
    out = torch.full_like(want, float("nan"), device=DEVICE)
    for _ in range(3):
        got = backend.forward(
            c.q, c.k_new, c.v_new, c.meta, kv_cache=(c.k_cache, c.v_cache), scale=0.25, out=out
        )
        assert got is out
        assert_close(out.cpu(), want)
    assert c.meta.state is state and len(state.launches) == 1


def test_int64_cache_offsets_give_the_same_result():
    # Caches past 2^31 elements take int64 offsets; tiny ones can take them too.
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=16, seed=7)
    want = forward(TorchReferenceBackend(), copy_case(case), 0.25)
    c = copy_case(case, DEVICE)
    write_kv(c.k_new, c.v_new, c.k_cache, c.v_cache, c.meta.slot_mapping)
    out = torch.empty_like(c.q)
    attention.paged_attention(
        c.q, c.k_cache, c.v_cache, out, c.meta.cu_seqlens_q, c.meta.seq_lens_k,
        c.meta.block_table, scale=0.25, block_m=16, tile_n=16, wide_offsets=True,
    )  # fmt: skip
    assert_close(out.cpu(), want)


def test_rows_without_visible_keys_are_zero():
    # More queries than keys: the first two rows of the second sequence see no key.
    case = make_case([(2, 9), (4, 2)], num_heads=4, kv_heads=4, head_dim=16)
    c = copy_case(case, DEVICE)
    got = forward(TritonPagedBackend(TILE32), c, 0.25).cpu()
    assert torch.isfinite(got).all()
    assert (got[2:4] == 0).all()
    want = dense_attention(case, 0.25)[:2]
    torch.testing.assert_close(got[:2].double(), want, atol=2e-5, rtol=1e-5)


def test_kv_write_matches_reference_write():
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=16, seed=6)
    want = copy_case(case)
    write_kv(want.k_new, want.v_new, want.k_cache, want.v_cache, want.meta.slot_mapping)
    got = copy_case(case, DEVICE)
    kv = torch.randn(got.k_new.shape[0], 2, 2, 16, device=DEVICE)  # strided k/v views
    kv[:, 0], kv[:, 1] = got.k_new, got.v_new
    TritonPagedBackend().write_kv(kv[:, 0], kv[:, 1], (got.k_cache, got.v_cache), got.meta)
    assert torch.equal(got.k_cache.cpu(), want.k_cache)
    assert torch.equal(got.v_cache.cpu(), want.v_cache)


def test_kv_write_casts_to_the_cache_dtype_and_skips_negative_slots():
    k_cache = torch.zeros(3, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 11], device=DEVICE)
    triton_kv_write.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], k[0].half()) and torch.equal(v_cache[2, 3], v[2].half())
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # the -1 token wrote nothing


def test_why_not(monkeypatch: pytest.MonkeyPatch):
    ok = dict(dtype=torch.float32, head_dim=64, block_size=16)
    cpu = torch.device("cpu")
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        reason = TritonPagedBackend.why_not(device=cpu, **ok)
        assert reason is not None and "TRITON_INTERPRET=1" in reason
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonPagedBackend.why_not(device=DEVICE, **ok) is None
    reason = TritonPagedBackend.why_not(device=DEVICE, **{**ok, "dtype": torch.int8})
    assert reason is not None and "dtype torch.int8" in reason
    for head_dim in (8, 72, 256):
        reason = TritonPagedBackend.why_not(device=DEVICE, **{**ok, "head_dim": head_dim})
        assert reason is not None and f"head_dim {head_dim}" in reason
    assert TritonPagedBackend.why_not(device=torch.device("meta"), **ok) is not None
    if DEVICE.type == "cpu":
        reason = TritonPagedBackend.why_not(device=cpu, **{**ok, "dtype": torch.bfloat16})
        assert reason is not None and "interpreter" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU choice")
def test_registry_never_picks_the_interpreter_unasked(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("TRITON_INTERPRET")  # as in every other test module
    with caplog.at_level(logging.INFO, logger="firstlight.kernels"):
        backend = select_backend(
            None, device="cpu", dtype=torch.float32, head_dim=64, block_size=16
        )
    assert backend.name != "triton_paged"
    assert "triton_paged (priority 50) skipped: device cpu is not CUDA" in caplog.text
