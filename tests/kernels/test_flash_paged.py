"""The FlashAttention backend's adapter (`kernels.flash_paged`) on the CPU: where it says it
cannot run, and the arguments it hands each build, checked by running them through the torch
reference (a stand-in for the CUDA kernel with the same signature). tests/gpu/test_flash_gpu.py
runs a real build where one imports."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.flash_paged import FlashBuild, FlashPagedBackend, FlashState, find_build
from kernels.interface import AttentionMetadata
from kernels.reference import TorchReferenceBackend
from kernels.registry import select_backend
from tests.kernels.helpers import copy_case, make_case


def reference(q, k_cache, v_cache, cu_q, lens_k, table, max_q, max_k, scale) -> torch.Tensor:
    meta = AttentionMetadata(cu_q, lens_k, table, torch.zeros(0), max_q, max_k, k_cache.shape[1])
    ref = TorchReferenceBackend()
    return ref.attend(q, (k_cache, v_cache), meta, ref.build_state(meta), scale=scale)


def vllm_style(*, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
               softmax_scale, causal, block_table):  # fmt: skip
    assert causal
    out.copy_(reference(q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
                        max_seqlen_k, softmax_scale))  # fmt: skip


def fa4_style(*, q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
              softmax_scale, causal, page_table):  # fmt: skip
    assert causal
    out = reference(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k,
                    softmax_scale)  # fmt: skip
    return out, torch.zeros(q.shape[0], q.shape[1])  # (out, lse)


def fa2_style(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
              softmax_scale, causal, block_table):  # fmt: skip
    assert causal
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return reference(q, k, v, cu_seqlens_q, lens, block_table, max_seqlen_q, max_seqlen_k,
                     softmax_scale)  # fmt: skip


BUILDS = {
    "seqused_k": FlashBuild("stand-in", vllm_style, True, 16),
    "page_table": FlashBuild("stand-in", fa4_style, True, 16, (), "page_table", False),
    "cu_seqlens_k": FlashBuild("stand-in", fa2_style, False, 256),
}


def test_it_never_serves_without_a_gpu():
    reason = FlashPagedBackend.why_not(
        device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=128, block_size=16
    )
    assert reason is not None and "CUDA" in reason
    assert select_backend(None, device="cpu", dtype=torch.float32, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", device="cpu", dtype=torch.float32, head_dim=16, block_size=16)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) for m in ("vllm_flash_attn", "vllm", "flash_attn")),
    reason="a FlashAttention build is installed here",
)
def test_without_a_build_it_says_what_it_tried():
    found = find_build()
    assert isinstance(found, str)
    for module in ("vllm_flash_attn", "flash_attn.cute", "flash_attn"):
        assert f"{module}: not installed" in found
    with pytest.raises(RuntimeError, match="no FlashAttention build"):
        FlashPagedBackend()


@pytest.mark.parametrize("style", sorted(BUILDS))
def test_each_build_gets_the_step_it_must_compute(style):
    case = make_case([(13, 45), (1, 37), (3, 50), (9, 9)], num_heads=4, kv_heads=2, head_dim=16)
    ours, ref = copy_case(case), copy_case(case)
    backend = FlashPagedBackend(BUILDS[style])
    state = backend.prepare(ours.meta)
    assert isinstance(state, FlashState) and (state.cu_seqlens_k is None) == (
        style != "cu_seqlens_k"
    )
    kv = (ours.k_cache, ours.v_cache)
    got = backend.forward(ours.q, ours.k_new, ours.v_new, ours.meta, kv_cache=kv, scale=0.3)
    want = TorchReferenceBackend().forward(
        ref.q, ref.k_new, ref.v_new, ref.meta, kv_cache=(ref.k_cache, ref.v_cache), scale=0.3
    )
    torch.testing.assert_close(got, want)


def test_a_replay_rebuilds_cu_seqlens_k_for_every_graph_of_the_bucket():
    backend = FlashPagedBackend(BUILDS["cu_seqlens_k"])
    backend.init_capture(4, 8, torch.device("cpu"), 256)
    short, long = backend.prepare_for_capture(4, 512), backend.prepare_for_capture(4, 2048)
    assert isinstance(short.state, FlashState) and short.state is long.state
    live = AttentionMetadata(
        cu_seqlens_q=torch.arange(4, dtype=torch.int32),
        seq_lens_k=torch.tensor([300, 7, 512], dtype=torch.int32),
        block_table=torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32),
        slot_mapping=torch.tensor([299, 6 + 3 * 256, 511 + 5 * 256]),
        max_seqlen_q=1,
        max_seqlen_k=512,
    )
    backend.prepare_for_replay(4, live)
    assert short.state.cu_seqlens_k is not None
    assert short.state.cu_seqlens_k.tolist() == [0, 300, 307, 819, 819]  # padding: no keys
