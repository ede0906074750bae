"""Llama-family models loaded from HF checkpoints against transformers' own implementation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.loader import load_model, read_model_info
from engine.models.spec import ModelSpec
from kernels.interface import AttentionMetadata
from kernels.reference import TorchReferenceBackend
from tests.engine.hf_tiny import FAMILIES, random_prompt

BLOCK = 16


def prompt_logits(path: Path, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    """All-position logits of one prompt, prefilled in one step on reversed blocks."""
    backend = TorchReferenceBackend()
    model, info = load_model(path, dtype, "cpu", backend)
    n = len(prompt)
    num_blocks = (n + BLOCK - 1) // BLOCK
    blocks = list(range(2 * num_blocks))[::-2]  # non-contiguous, descending
    shape = (2 * num_blocks, BLOCK, info.num_kv_heads, info.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(info.num_layers)
    ]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens_k=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([blocks[:num_blocks]], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]),
        max_seqlen_q=n,
        max_seqlen_k=n,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), caches, meta)
        assert hidden.shape == (n, info.hidden_size)
        return model.compute_logits(hidden).float()


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompt_logits_match_transformers(family: str, checkpoints):
    hf_model, path = checkpoints[family]
    prompt = random_prompt(37, seed=3)
    got = prompt_logits(path, prompt)
    want = hf_logits(hf_model, prompt)
    assert want.abs().max() > 1.0  # logits carry signal, so 1e-4 is a real bound
    assert (got - want).abs().max() < 1e-4


def test_sharded_checkpoint_loads_identically(checkpoints, tmp_path: Path):
    hf_model, path = checkpoints["llama3"]
    hf_model.save_pretrained(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompt = random_prompt(20, seed=4)
    torch.testing.assert_close(prompt_logits(tmp_path, prompt), prompt_logits(path, prompt))


def test_bfloat16_load_is_close_to_float32(checkpoints):
    hf_model, path = checkpoints["qwen3"]
    model, info = load_model(path, "bfloat16", "cpu", TorchReferenceBackend())
    assert info.dtype is torch.bfloat16
    assert all(p.dtype is torch.bfloat16 for p in model.parameters())
    prompt = random_prompt(30, seed=5)
    low = prompt_logits(path, prompt, dtype=torch.bfloat16)
    full = hf_logits(hf_model, prompt)
    assert torch.isfinite(low).all()
    assert (low - full).abs().max() < 0.05 * full.abs().max()
    assert (low.argmax(-1) == full.argmax(-1)).float().mean() > 0.8


def test_model_info_reads_config_and_generation_config(checkpoints, tmp_path: Path):
    _, path = checkpoints["qwen3"]
    info = read_model_info(path, "float32")
    assert (info.model_type, info.num_layers, info.num_heads, info.num_kv_heads) == (
        "qwen3",
        2,
        4,
        1,
    )
    assert (info.head_dim, info.hidden_size, info.vocab_size) == (32, 64, 256)
    assert info.max_position_embeddings == 256 and info.eos_token_ids == ()

    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 3]}))
    assert read_model_info(tmp_path, torch.bfloat16).eos_token_ids == (3, 7, 9)


def test_sliding_window_caps_the_context():
    base = dict(
        model_type="mistral",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32768,
    )
    assert ModelSpec.from_hf_config({**base, "sliding_window": 4096}).max_position_embeddings == (
        4096
    )
    assert ModelSpec.from_hf_config({**base, "sliding_window": None}).max_position_embeddings == (
        32768
    )


def test_old_and_new_rope_config_layouts_agree():
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    old = ModelSpec.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    new = ModelSpec.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}
    )
    assert old.rope == new.rope and old.rope.theta == 5e5 and old.rope.factor == 4.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str):
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config({**base, **change})


def test_missing_or_unexpected_weights_are_refused(checkpoints, tmp_path: Path):
    _, path = checkpoints["qwen2_tied"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")

    missing = {k: v for k, v in weights.items() if not k.endswith("layers.1.self_attn.k_proj.bias")}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights.*qkv_proj\.bias\[shard 1\]"):
        load_model(tmp_path, "float32", "cpu", TorchReferenceBackend())

    extra = {**weights, "model.layers.0.mlp.experts.0.weight": torch.zeros(2)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight"):
        load_model(tmp_path, "float32", "cpu", TorchReferenceBackend())

    bad = {**weights, "model.norm.weight": torch.zeros(3)}
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="shape"):
        load_model(tmp_path, "float32", "cpu", TorchReferenceBackend())


def test_one_metadata_object_serves_every_layer(checkpoints):
    """The model prepares the backend's state once per step and hands every layer the same
    metadata, with this layer's new K/V to write (the write is the backend's)."""
    calls: list[tuple[str, object]] = []

    class Recording(TorchReferenceBackend):
        def build_state(self, meta):
            calls.append(("build_state", meta))
            return super().build_state(meta)

        def write_kv(self, k, v, kv_cache, meta):
            calls.append(("write_kv", meta))
            super().write_kv(k, v, kv_cache, meta)

    _, path = checkpoints["qwen3"]  # 2 layers
    model, _ = load_model(path, "float32", "cpu", Recording())
    n = 5
    caches = [(torch.zeros(2, BLOCK, 1, 32), torch.zeros(2, BLOCK, 1, 32)) for _ in range(2)]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens_k=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.arange(BLOCK, BLOCK + n),
        max_seqlen_q=n,
        max_seqlen_k=n,
    )
    with torch.inference_mode():
        model(torch.tensor(random_prompt(n, seed=1)), torch.arange(n), caches, meta)
    assert calls == [("build_state", meta), ("write_kv", meta), ("write_kv", meta)]
    for k_cache, v_cache in caches:  # each layer's own K/V landed in block 1, nowhere else
        assert k_cache[1, :n].abs().sum() > 0 and v_cache[1, :n].abs().sum() > 0
        assert not k_cache[0].any() and not k_cache[1, n:].any()
