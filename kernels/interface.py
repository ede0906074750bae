"""The attention-backend contract shared by every kernel in this package.

KV caches are per layer, shaped `[num_blocks, block_size, num_kv_heads, head_dim]` (block size
16 by default). A step's queries are packed: the new tokens of every scheduled sequence laid
end to end, `q: [num_tokens, num_heads, head_dim]`, with `cu_seqlens_q` marking where each
sequence starts. Sequence `i` attends to its first `seq_lens_k[i]` cached positions (which
already include this step's new tokens: KV is written before attention runs), found through
`block_table[i]`. The causal mask is aligned bottom-right: query row `r` of a sequence with
`L_q` new tokens and `L_k` keys sees keys `j <= r + (L_k - L_q)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once per step and shared by all layers.

    `slot_mapping[t]` is the flat cache slot (`block_id * block_size + offset`) that token `t`'s
    K/V is written to. `extra` holds whatever a backend precomputes in `prepare()` (gather
    indices, masks) so that per-layer calls do no repeated work.
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_k: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int = 16
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_k.shape[0])


class AttentionBackend(ABC):
    """A paged attention implementation. Stateless apart from what `prepare` caches on meta."""

    name: str = "abstract"

    @classmethod
    @abstractmethod
    def supports(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> bool:
        """Whether this backend can run here (device, dtype, shapes, importable deps)."""

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute per-step state into `meta.extra`; called once per step before layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        seq_lens_k: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        scale: float,
        out: torch.Tensor | None = None,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Paged causal attention: `[num_tokens, num_heads, head_dim]`, in `out` if given."""
