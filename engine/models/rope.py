"""Rotary position embeddings (the "rotate half" layout HF Llama checkpoints use).

Frequencies follow transformers' `default`, `linear` and `llama3` rope types exactly (float32).
`cos`/`sin` for the step's positions are looked up once per step and shared by all layers; the
table grows on demand (doubling), so a short-context deployment never pays for a long one.
"""

from __future__ import annotations

import math

import torch

from engine.models.spec import RopeSpec


def inverse_frequencies(spec: RopeSpec, head_dim: int, device: torch.device) -> torch.Tensor:
    """`[head_dim // 2]` float32 inverse frequencies after the spec's scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        return _llama3_scaling(inv_freq, spec)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    old_len = spec.original_max_position_embeddings
    low_freq_wavelen = old_len / spec.low_freq_factor
    high_freq_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds the inverse frequencies; `cos_sin(positions)` is called once per forward."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device):
        self.inv_freq = inverse_frequencies(spec, head_dim, device)
        self._tables: dict[torch.dtype, torch.Tensor] = {}  # [positions, 2, head_dim // 2]

    def _table(self, needed: int, dtype: torch.dtype) -> torch.Tensor:
        table = self._tables.get(dtype)
        if table is None or table.shape[0] < needed:
            size = max(needed, 2 * (0 if table is None else table.shape[0]), 256)
            positions = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq[None, :]
            table = torch.stack((freqs.cos(), freqs.sin()), dim=1).to(dtype)
            self._tables[dtype] = table
        return table

    def reserve(self, positions: int, dtype: torch.dtype) -> None:
        """Grow the table to `positions` rows now: a CUDA graph captures the table's address,
        so it must not grow afterwards."""
        self._table(positions, dtype)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T, 1, head_dim // 2]` cos and sin in `dtype`, broadcastable over heads.

        `max_position` (the largest entry of `positions`, if the caller knows it) spares a
        device-to-host read.
        """
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        cs = self._table(max_position + 1, dtype).index_select(0, positions)
        return cs[:, 0:1, :], cs[:, 1:2, :]
