"""Every CPU backend against plain dense attention, one sequence at a time, through the
backend interface the model uses (`prepare` once, then `forward(q, k, v, meta)` per layer)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_paged import CpuPagedBackend, CpuPagedState
from kernels.interface import GraphsUnsupported
from kernels.kv_write import write_kv
from kernels.reference import ReferenceState, TorchReferenceBackend
from tests.kernels.helpers import BLOCK, dense_attention, make_case, run_backend

LAYOUTS = {
    "mixed": [(1, 37), (5, 53), (20, 20), (1, 1), (9, 100)],  # decode, mid chunks, full
    "decode_batch": [(1, 17), (1, 3), (1, 64), (1, 31)],
    "equal_chunks": [(7, 7), (7, 40), (7, 23)],
    "single_full": [(45, 45)],
    "single_chunk": [(13, 77)],
    "single_decode": [(1, 70)],
    # decodes verifying drafts (short queries) beside plain decodes and a short prefill
    "spec_verify": [(9, 40), (1, 30), (5, 17), (3, 3), (1, 2)],
}


def _cpu_kernel_backend():
    cpu = torch.device("cpu")
    if not CpuPagedBackend.supports(device=cpu, dtype=torch.float32, head_dim=64, block_size=BLOCK):
        pytest.skip("the C++ CPU kernel cannot be compiled here")
    return CpuPagedBackend


BACKENDS = {"torch_ref": lambda: TorchReferenceBackend, "cpu_paged": _cpu_kernel_backend}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("use_prepare", [True, False])
def test_matches_dense_attention(
    backend: str, layout: str, group: int, head_dim: int, use_prepare: bool
):
    backend_cls = BACKENDS[backend]()
    case = make_case(LAYOUTS[layout], num_heads=8, kv_heads=8 // group, head_dim=head_dim)
    scale = head_dim**-0.5
    got = run_backend(case, scale, use_prepare=use_prepare, backend_cls=backend_cls)
    want = dense_attention(case, scale)
    assert got.shape == case.q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_writes_into_out_and_prepare_is_shared_by_layers():
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=64)
    backend = TorchReferenceBackend()
    state = backend.prepare(case.meta)
    assert isinstance(state, ReferenceState) and case.meta.state is state
    assert backend.prepare(case.meta) is state  # idempotent: the plan is built once per step
    out = torch.empty_like(case.q)
    got = backend.forward(
        case.q,
        case.k_new,
        case.v_new,
        case.meta,
        kv_cache=(case.k_cache, case.v_cache),
        scale=0.125,
        out=out,
    )
    assert got is out and case.meta.state is state
    torch.testing.assert_close(out.double(), dense_attention(case, 0.125), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_forward_writes_the_new_kv_at_the_slot_mapping(backend: str):
    case = make_case(LAYOUTS["mixed"], num_heads=4, kv_heads=2, head_dim=32)
    slots = case.meta.slot_mapping
    flat_k = case.k_cache.view(-1, 2, 32)
    assert not torch.equal(flat_k[slots], case.k_new)  # garbage before the step
    run_backend(case, 0.125, use_prepare=False, backend_cls=BACKENDS[backend]())
    torch.testing.assert_close(flat_k[slots], case.k_new, atol=0, rtol=0)
    torch.testing.assert_close(case.v_cache.view(-1, 2, 32)[slots], case.v_new, atol=0, rtol=0)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_state_is_built_once_per_step_for_all_layers(backend: str):
    backend_cls = BACKENDS[backend]()
    builds = []

    class Counting(backend_cls):  # type: ignore[valid-type,misc]
        def build_state(self, meta):
            builds.append(meta)
            return super().build_state(meta)

    case = make_case(LAYOUTS["mixed"], num_heads=8, kv_heads=2, head_dim=64)
    got = run_backend(case, 0.125, use_prepare=True, backend_cls=Counting, layers=4)
    assert builds == [case.meta]
    torch.testing.assert_close(got.double(), dense_attention(case, 0.125), atol=2e-5, rtol=1e-5)


def test_cpu_kernel_state_converts_short_query_groups_once():
    backend = _cpu_kernel_backend()()
    case = make_case(LAYOUTS["mixed"], num_heads=8, kv_heads=2, head_dim=64)
    state = backend.prepare(case.meta)
    assert isinstance(state, CpuPagedState)
    # mixed: the decode group (sequences 0 and 3) through the kernel; the longer group has a
    # 20-token query, past SHORT_QUERY: SDPA
    decode, longer = state.kernel
    assert decode is not None and longer is None
    assert decode.block_table.dtype == torch.int32
    assert decode.block_table.is_contiguous()
    assert decode.seq_lens_k.tolist() == [37, 1]
    assert decode.rows.tolist() == [0, 1]
    # short queries become one kernel row per query token, each seeing keys up to itself
    short = backend.prepare(make_case([(3, 9), (2, 2)], 8, 2, 64).meta)
    assert isinstance(short, CpuPagedState)
    (args,) = short.kernel
    assert args is not None
    assert args.seq_lens_k.tolist() == [7, 8, 9, 1, 2]
    assert args.rows.tolist() == [0, 1, 2, 3, 4]
    table = short.groups[0].block_table
    assert args.block_table.tolist() == [table[0].tolist()] * 3 + [table[1].tolist()] * 2
    long_only = backend.prepare(make_case([(17, 20), (30, 30)], 8, 2, 64).meta)
    assert long_only.kernel == [None]  # type: ignore[attr-defined]
    # a state built by the reference backend is not mistaken for the kernel's own
    ref_meta = make_case(LAYOUTS["decode_batch"], num_heads=8, kv_heads=2, head_dim=64).meta
    TorchReferenceBackend().prepare(ref_meta)
    assert isinstance(backend.prepare(ref_meta), CpuPagedState)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_cpu_backends_declare_no_cuda_graph_support(backend: str):
    instance = BACKENDS[backend]()()
    assert instance.supports_graphs is False
    meta = make_case(LAYOUTS["decode_batch"], num_heads=4, kv_heads=4, head_dim=32).meta
    with pytest.raises(GraphsUnsupported, match="does not support CUDA graphs"):
        instance.init_capture(8, 4, torch.device("cpu"), 16)
    with pytest.raises(GraphsUnsupported):
        instance.prepare_for_capture(4, 512)
    with pytest.raises(GraphsUnsupported):
        instance.prepare_for_replay(4, meta)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("use_prepare", [True, False])
def test_rows_without_visible_keys_stay_finite(backend: str, use_prepare: bool):
    # More queries than keys: the first rows of the second sequence see no key at all.
    # make_case caches the first sequence's 7 old keys; the first 2 of the second sequence
    # are "new" and written into the cache here, so only the attention half runs below.
    instance = BACKENDS[backend]()()
    case = make_case([(2, 9), (4, 2)], num_heads=4, kv_heads=4, head_dim=64)
    write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.meta.slot_mapping)
    case.meta.slot_mapping = torch.arange(case.q.shape[0])  # one slot per query row
    state = instance.prepare(case.meta) if use_prepare else instance.build_state(case.meta)
    kv = (case.k_cache, case.v_cache)
    out = instance.attend(case.q, kv, case.meta, state, scale=0.125)
    assert torch.isfinite(out).all()
    # Rows that do see keys are still exact.
    want = dense_attention(case, 0.125)[:2]
    torch.testing.assert_close(out[:2].double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_dense(dtype: torch.dtype):
    case = make_case(LAYOUTS["mixed"], num_heads=8, kv_heads=2, head_dim=64, dtype=dtype)
    got = run_backend(case, 0.125, use_prepare=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), dense_attention(case, 0.125), atol=3e-2, rtol=3e-2)


def test_write_kv_targets_slots():
    k_cache = torch.zeros(4, BLOCK, 2, 8)
    v_cache = torch.zeros(4, BLOCK, 2, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    write_kv(k, v, k_cache, v_cache, torch.tensor([5, 3 * BLOCK, 2 * BLOCK + 15]))
    torch.testing.assert_close(k_cache[0, 5], k[0])
    torch.testing.assert_close(k_cache[3, 0], k[1])
    torch.testing.assert_close(v_cache[2, 15], v[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3
