"""Building a model from a local HF directory: `config.json` plus `*.safetensors` shards.

Weights are read straight from safetensors (one tensor at a time, so peak host memory stays
near one tensor) and mapped onto our modules by `LlamaForCausalLM.load_weights`; the
transformers model classes are never used. The model is first built on the meta device, so
no memory is spent on a random initialisation that would be overwritten.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ModelSpec
from kernels.interface import AttentionBackend
from kernels.layer_ops import LayerShape, select_layer_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the rest of the engine needs to know about a loaded model (plain, picklable)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int  # capped at the sliding window when the model has one
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json, sorted
    model_type: str
    dtype: torch.dtype


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (use one of {list(DTYPES)})")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (use one of {list(DTYPES)})")
    return DTYPES[dtype]


def read_spec(path: str | Path) -> ModelSpec:
    return ModelSpec.from_hf_config(_read_json(Path(path) / "config.json"))


def read_model_info(path: str | Path, dtype: str | torch.dtype) -> ModelInfo:
    """The model's shape and EOS ids without loading any weights."""
    path = Path(path)
    spec = read_spec(path)
    eos: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            eos.update(_as_ids(_read_json(path / name).get("eos_token_id")))
    return ModelInfo(
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        eos_token_ids=tuple(sorted(eos)),
        model_type=spec.model_type,
        dtype=resolve_dtype(dtype),
    )


def load_model(
    path: str | Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    backend: AttentionBackend,
    fused_ops: bool | None = False,
) -> tuple[LlamaForCausalLM, ModelInfo]:
    """An eval-mode model with every weight loaded, on `device` in `dtype`, and its info.
    `fused_ops` chooses how it runs its element-wise stages (`kernels.layer_ops.
    select_layer_ops`: False, torch's ops; None, fused kernels where they run and pass)."""
    path = Path(path)
    info = read_model_info(path, dtype)
    device = torch.device(device)
    spec = read_spec(path)
    shape = LayerShape(
        hidden=spec.hidden_size,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate=spec.intermediate_size,
        qk_norm=spec.qk_norm,
    )
    ops = select_layer_ops(fused_ops, device=device, dtype=info.dtype, shape=shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, backend, device, ops)
    model = model.to(dtype=info.dtype).to_empty(device=device)
    with torch.no_grad():
        model.load_weights(iter_safetensors(path))
    model.eval().requires_grad_(False)
    return model, info


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, shard by shard (the index file names the shards)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = [path / f for f in sorted(set(_read_json(index)["weight_map"].values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _read_json(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return json.load(f)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
