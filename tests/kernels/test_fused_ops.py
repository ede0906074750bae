"""The fused layer kernels (kernels.triton.fused through `TritonOps`) against torch's ops.

Without CUDA they run on CPU tensors through Triton's interpreter, with the same import
rules as test_triton_paged.py (see its docstring): in a whole-suite CPU run this module is
skipped and `test_triton_interpreter.py` runs it in a fresh process. With CUDA the same tests
run the compiled kernels, bfloat16 included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.runner.model_runner import ModelRunner
from engine.sched.output import ScheduledChunk, SchedulerOutput
from kernels.layer_ops import TorchOps, TritonOps, rms_norm, select_layer_ops
from tests.engine.engine_fixture import greedy, make_request, prompt_ids, tiny_config
from tests.engine.hf_tiny import (
    FAMILIES,
    greedy_with_runner,
    make_hf_model,
    make_sequence,
    random_prompt,
)
from tests.kernels.helpers import triton_kernel_device

DEVICE = triton_kernel_device()  # imports triton under the interpreter on a CPU host

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# float32: summation order only; 16-bit: one unit in the last place of an output near 4
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def interpreter_on(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256])
def test_add_rms_norm_adds_into_the_residual_and_normalises(dtype, hidden) -> None:
    x, res, w = (
        rand(5, hidden, dtype=dtype),
        rand(5, hidden, dtype=dtype, seed=1),
        rand(hidden, dtype=dtype, seed=2),
    )
    want_out, want_h = TorchOps().add_rms_norm(x, res, w, 1e-5)
    residual = res.clone()
    out, h = TritonOps().add_rms_norm(x, residual, w, 1e-5)
    assert h.data_ptr() == residual.data_ptr()  # the sum lands in the residual, in place
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # one rounded add, as torch's
    close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_a_residual_leaves_its_input(dtype) -> None:
    x, w = rand(3, 80, dtype=dtype), rand(80, dtype=dtype, seed=2)
    before = x.clone()
    out, h = TritonOps().add_rms_norm(x, None, w, 1e-6)
    assert h is x and torch.equal(x, before)
    close(out, TorchOps().add_rms_norm(x, None, w, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_the_q_and_k_heads_of_a_fused_projection_in_place(dtype) -> None:
    nq, nkv, head_dim = 6, 2, 32
    qkv = rand(7, nq + 2 * nkv, head_dim, dtype=dtype)
    cs = rand(7, 2, head_dim // 2, dtype=dtype, seed=3)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    want = TorchOps().rope(qkv[:, : nq + nkv], cos, sin)
    v_before = qkv[:, nq + nkv :].clone()
    got = TritonOps().rope(qkv[:, : nq + nkv], cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    if dtype == torch.float32:
        close(qkv[:, : nq + nkv], want, dtype)
    else:  # each product and sum rounded where torch rounds them: bit for bit
        assert torch.equal(qkv[:, : nq + nkv], want)
    assert torch.equal(qkv[:, nq + nkv :], v_before)  # v's heads untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("nq", "nkv", "head_dim"), [(6, 2, 32), (4, 4, 64), (3, 1, 16)])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_rotates_q_and_writes_the_rotated_k_and_v_at_their_slots(
    dtype, nq, nkv, head_dim, separate, qk_norm
) -> None:
    """As (the q/k norms,) `rope` on q and k, then the K/V write, bit for bit in 16-bit
    dtypes but for the norms' float32 sums: q rotated in place; k rotated into the cache, v
    copied, at each token's slot; a slot of -1 (a graph bucket's padding row) writes nothing;
    k itself and every other slot stay as they were. q, k and v as strided views of a fused
    projection, or separate tensors."""
    tokens, blocks, block_size, eps = 7, 3, 4, 1e-6
    qkv = rand(tokens, nq + 2 * nkv, head_dim, dtype=dtype)
    q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
    if separate:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cs = rand(tokens, 2, head_dim // 2, dtype=dtype, seed=3)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    slots = torch.tensor([9, 0, -1, 4, 11, 2, 5], device=DEVICE)
    fill = rand(2, blocks, block_size, nkv, head_dim, dtype=dtype, seed=4)
    norms = (rand(head_dim, dtype=dtype, seed=5), rand(head_dim, dtype=dtype, seed=6), eps)
    k_before = k.clone()

    ref = TorchOps()
    want_q, want_k = q.clone(), k.clone()
    if qk_norm:
        want_q, want_k = rms_norm(want_q, norms[0], eps), rms_norm(want_k, norms[1], eps)
    want_q, want_k = ref.rope(want_q, cos, sin), ref.rope(want_k, cos, sin)
    want = fill.clone().view(2, blocks * block_size, nkv, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[0, slot], want[1, slot] = want_k[t], v[t]

    cache = fill.clone()
    got_q = TritonOps().rope_write_kv(
        q, k, v, cos, sin, (cache[0], cache[1]), slots, norms if qk_norm else None
    )
    assert got_q.data_ptr() == q.data_ptr()  # in place
    got = cache.view(2, blocks * block_size, nkv, head_dim)
    if dtype == torch.float32 or qk_norm:
        close(got_q, want_q, dtype)
        close(got, want, dtype)
    else:
        assert torch.equal(got_q, want_q) and torch.equal(got, want)
    assert torch.equal(k, k_before)  # only the cache holds k's rotation
    if not separate:
        assert torch.equal(qkv[:, nq + nkv :], v)  # v's heads untouched


def test_layers_on_fused_ops_write_kv_in_the_rope_kernel_where_the_backend_allows() -> None:
    """TritonOps and a backend with the standard cache: each layer calls `rope_write_kv`
    and never the backend's `write_kv`; torch's ops keep the backend's write, and so does a
    backend that declares another cache layout (`standard_kv_write` False)."""

    def calls(fused: bool) -> dict[str, int]:
        engine = LLMEngine(
            tiny_config(device=DEVICE.type, fused_ops=fused, attention_backend="torch_ref")
        )
        model, backend = engine.runner.model, engine.runner.backend
        counts = {"rope_write_kv": 0, "write_kv": 0}

        def counted(owner: object, name: str) -> None:
            fn = getattr(owner, name)

            def wrapped(*args, **kwargs):
                counts[name] += 1
                return fn(*args, **kwargs)

            setattr(owner, name, wrapped)  # on the instance: nothing else sees it

        counted(model.ops, "rope_write_kv")
        counted(backend, "write_kv")
        engine.add_request(make_request("r", prompt_ids(0, 9), greedy(3)))
        while engine.has_unfinished():
            engine.step()
        assert all(layer.self_attn.fused_kv_write == fused for layer in model.layers)
        return counts

    fused, plain = calls(True), calls(False)
    assert fused["write_kv"] == 0 and fused["rope_write_kv"] == plain["write_kv"] > 0
    assert plain["rope_write_kv"] == 0

    from engine.models.llama import Attention
    from kernels.reference import TorchReferenceBackend

    class OwnLayout(TorchReferenceBackend):
        standard_kv_write = False

    spec = LLMEngine(tiny_config(device=DEVICE.type)).runner.model.spec
    assert Attention(spec, TorchReferenceBackend(), TritonOps()).fused_kv_write
    assert not Attention(spec, OwnLayout(), TritonOps()).fused_kv_write
    assert not Attention(spec, TorchReferenceBackend(), TorchOps()).fused_kv_write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 1500])  # one column tile; two, the second part-masked
def test_silu_mul(dtype, size) -> None:
    gate_up = rand(4, 2 * size, dtype=dtype) * 3
    close(TritonOps().silu_mul(gate_up), TorchOps().silu_mul(gate_up), dtype)


def test_no_tokens() -> None:
    ops = TritonOps()
    empty = torch.empty(0, 64, device=DEVICE)
    out, h = ops.add_rms_norm(empty, empty.clone(), torch.ones(64, device=DEVICE), 1e-6)
    assert out.shape == (0, 64) and h.shape == (0, 64)
    assert ops.rope(torch.empty(0, 4, 16, device=DEVICE), empty[:, :8], empty[:, :8]).numel() == 0
    assert ops.silu_mul(empty).shape == (0, 32)
    q, kv = torch.empty(0, 4, 16, device=DEVICE), torch.empty(0, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 1, 4, 2, 16, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert (
        ops.rope_write_kv(q, kv, kv, empty[:, :8], empty[:, :8], (cache[0], cache[1]), slots) is q
    )
    assert not cache.any()


def test_selected_where_the_kernels_run_and_passes_the_smoke_check() -> None:
    assert isinstance(select_layer_ops(None, device=DEVICE, dtype=torch.float32), TritonOps)


def test_an_engine_on_fused_ops_generates_what_torchs_ops_do() -> None:
    """The whole model, prefill chunks and decodes, greedy over 24 tokens (float32)."""

    def run(fused: bool) -> dict[str, list[int]]:
        engine = LLMEngine(
            tiny_config(device=DEVICE.type, fused_ops=fused, attention_backend="torch_ref")
        )
        assert isinstance(engine.runner.model.ops, TritonOps if fused else TorchOps)
        for i, n in enumerate((5, 19, 40)):
            engine.add_request(make_request(f"r{i}", prompt_ids(i, n), greedy(24)))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        return out

    assert run(True) == run(False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_model_family_runs_on_fused_ops_as_on_torchs(family, tmp_path) -> None:
    """Biases, tied embeddings, q/k norms (qwen3), head_dim apart from hidden / heads, MHA
    and GQA: fused and torch ops give the same greedy tokens and logits to float32 noise."""
    make_hf_model(family).save_pretrained(tmp_path)
    config = EngineConfig(
        model=str(tmp_path), device=DEVICE.type, attention_backend="torch_ref",
        cache=CacheConfig(num_blocks=16),
    )  # fmt: skip
    fused = ModelRunner(dataclasses.replace(config, fused_ops=True), str(tmp_path))
    plain = ModelRunner(dataclasses.replace(config, fused_ops=False), str(tmp_path))
    assert isinstance(fused.ops, TritonOps) and isinstance(plain.ops, TorchOps)
    prompt = random_prompt(21, seed=3)
    assert greedy_with_runner(fused, prompt, 12) == greedy_with_runner(plain, prompt, 12)
    seq_logits = [
        r.execute(SchedulerOutput([ScheduledChunk(make_sequence(prompt, 22, 16), 0, 21)]))
        for r in (fused, plain)
    ]
    torch.testing.assert_close(seq_logits[0], seq_logits[1], rtol=1e-4, atol=1e-4)
