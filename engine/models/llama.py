"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Interface: `model(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, hidden_size]`
(after the final norm; with `interrupt`, a callable asked before each layer and between each
layer's attention and MLP, the pass stops with `StepInterrupted` once it says True) and
`model.compute_logits(hidden[N, hidden_size]) -> [N, vocab]`.
`kv_caches[i]` is layer i's `(k_cache, v_cache)`. The forward calls `backend.prepare(meta)`
once; then each layer projects q/k/v, applies RoPE at `positions` and hands q, k, v to
`backend.forward`, which writes K/V at `meta.slot_mapping` and attends (or, with ops that
fuse RoPE into the K/V write and a backend with the standard cache, one kernel rotates q and
k and writes K/V, and `backend.attend` follows). q/k/v and gate/up
are fused into one matmul each; `load_weights` maps HF checkpoint names onto the fused
slices. The element-wise stages (residual add + RMSNorm, RoPE, SiLU-and-multiply) run
through `ops` (kernels.layer_ops: torch's ops, or one fused kernel each): layers pass
`(hidden, residual)` on, the residual added inside the next norm, as vLLM's models do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import RotaryEmbedding
from engine.models.spec import ModelSpec
from kernels.interface import AttentionBackend, AttentionMetadata, KVCache
from kernels.layer_ops import LayerOps, TorchOps, rms_norm


class StepInterrupted(Exception):
    """The forward pass stopped before a layer or before a layer's MLP because its `interrupt`
    said so. The K/V the layers that ran wrote sit at positions the step's sequences have not
    counted as computed, so the next step writes them again (the same tokens, same positions)."""


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.backend = backend
        self.ops = ops
        # RoPE and the K/V write in one kernel, where the ops have one for the backend's cache
        self.fused_kv_write = ops.fuses_kv_write and backend.standard_kv_write
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        self.shard_sizes = (q_size, kv_size, kv_size)  # q_proj, k_proj, v_proj rows
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        nq, nkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(h).view(num_tokens, nq + 2 * nkv, self.head_dim)
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        if self.fused_kv_write:  # one kernel (q/k norms,) rotates q and k and writes k and v
            norms = None
            if self.q_norm is not None and self.k_norm is not None:
                norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q = self.ops.rope_write_kv(q, k, v, cos, sin, kv_cache, meta.slot_mapping, norms)
            state = self.backend.prepare(meta)
            o = self.backend.attend(q, kv_cache, meta, state, scale=self.scale)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q = self.ops.rope(self.q_norm(q), cos, sin)
                k = self.ops.rope(self.k_norm(k), cos, sin)
            else:  # q and k rotate together in one pass
                qk = self.ops.rope(qkv[:, : nq + nkv], cos, sin)
                q, k = qk[:, :nq], qk[:, nq:]
            o = self.backend.forward(q, k, v, meta, kv_cache=kv_cache, scale=self.scale)
        return self.o_proj(o.reshape(num_tokens, nq * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: LayerOps):
        super().__init__()
        self.ops = ops
        size = spec.intermediate_size
        self.shard_sizes = (size, size)  # gate_proj, up_proj rows
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, backend, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, ops)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        interrupt: Callable[[], bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mlp_out, residual)`: the layer's output is their sum, which the next norm forms
        (`residual` None in the first layer, whose input is `h` alone)."""
        norm = self.input_layernorm
        x, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn(x, cos, sin, kv_cache, meta)
        if interrupt is not None and interrupt():  # the MLP is most of a layer's time
            raise StepInterrupted
        norm = self.post_attention_layernorm
        x, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


# HF checkpoint projection name -> (our fused module name, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that carry no weights this model uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        device: torch.device,
        ops: LayerOps | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.ops = ops if ops is not None else TorchOps()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, backend, self.ops) for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, torch.device(device))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        interrupt: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        self.backend.prepare(meta)
        h = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos, sin = self.rotary.cos_sin(positions, h.dtype, meta.max_seqlen_k - 1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if interrupt is not None and interrupt():
                raise StepInterrupted
            h, residual = layer(h, residual, cos, sin, kv_cache, meta, interrupt)
        return self.ops.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, vocab]` logits in the model dtype (tied models reuse the embedding matrix)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this model; raise ValueError on unknown, misshapen or
        missing weights, so a half-loaded model can never serve."""
        params = dict(self.named_parameters())
        fused_shards = self._fused_shards()
        pending: set[tuple[str, int | None]] = {(name, None) for name in params}
        for name, shards in fused_shards.items():
            pending.discard((name, None))
            pending.update((name, i) for i in range(len(shards)))
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith(_IGNORED_SUFFIXES) or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue  # some tied checkpoints also store lm_head
            target, shard = self._locate(name, params)
            dest = params[target].data
            if shard is not None:
                start, rows = fused_shards[target][shard]
                dest = dest.narrow(0, start, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            pending.discard((target, shard))
        if pending:
            missing = sorted(n if s is None else f"{n}[shard {s}]" for n, s in pending)
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}")

    def _locate(self, name: str, params: dict) -> tuple[str, int | None]:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                fused, shard = _FUSED[part]
                target = ".".join([*parts[:i], fused, *parts[i + 1 :]])
                if target in params:
                    return target, shard
        if name in params:
            return name, None
        raise ValueError(f"unexpected weight {name!r} for a {self.spec.model_type} model")

    def _fused_shards(self) -> dict[str, list[tuple[int, int]]]:
        """Fused parameter name -> [(row offset, rows)] per shard."""
        out: dict[str, list[tuple[int, int]]] = {}
        for mod_name, mod in self.named_modules():
            if isinstance(mod, Attention | MLP):
                fused = "qkv_proj" if isinstance(mod, Attention) else "gate_up_proj"
                starts = [sum(mod.shard_sizes[:i]) for i in range(len(mod.shard_sizes))]
                spans = list(zip(starts, mod.shard_sizes, strict=True))
                out[f"{mod_name}.{fused}.weight"] = spans
                if getattr(mod, fused).bias is not None:
                    out[f"{mod_name}.{fused}.bias"] = spans
        return out
