"""The architecture of a Llama-family checkpoint, read from its HF `config.json`.

One frozen description covers Llama 2/3, Mistral, Qwen2 and Qwen3: they differ only in
biases, per-head q/k norms, an explicit head_dim, tied embeddings and RoPE scaling. Both the
older config layout (`rope_theta` + `rope_scaling`) and the transformers 5 one
(`rope_parameters`) are understood. Anything this engine would compute differently from
the reference implementation raises ValueError instead of serving wrong tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of {kv_heads} kv heads"
            )
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = _sliding_window(cfg, model_type)
        if window is not None and window < max_pos:
            max_pos = window  # full attention equals sliding-window attention up to the window
        # Llama and Qwen3 put `attention_bias` on q/k/v/o; Qwen2 always biases q/k/v only.
        attention_bias = model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias"))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_rope_spec(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _rope_spec(cfg: dict[str, Any]) -> RopeSpec:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 8192)
        ),
    )
