"""The attention-backend contract shared by every kernel in this package.

KV caches are per layer, a `(k_cache, v_cache)` pair each shaped `[num_blocks, block_size,
num_kv_heads, head_dim]` (block size 16 by default). A step's queries are packed: the new
tokens of every scheduled sequence laid end to end, `q: [num_tokens, num_heads, head_dim]`,
with `cu_seqlens_q` marking where each sequence starts. Sequence `i` attends to its first
`seq_lens_k[i]` cached positions (which include this step's new tokens: `forward` writes
their K/V before attention runs), found through `block_table[i]`. The causal mask is aligned
bottom-right: query row `r` of a sequence with `L_q` new tokens and `L_k` keys sees keys
`j <= r + (L_k - L_q)`.

One step, as the model runs it:

    state = backend.prepare(meta)      # once per step: per-step precompute, kept on meta
    for each layer:
        o = backend.forward(q, k, v, meta, kv_cache=layer_cache, scale=scale)

or, where the layer ops write K/V themselves (RoPE fused with the write, `kernels.layer_ops`;
only for a backend whose `standard_kv_write` is True), each layer writes `layer_cache` at
`meta.slot_mapping` and calls `backend.attend(q, layer_cache, meta, state, scale=scale)`.

CUDA graphs (`engine.runner.graphs`): a runner that captures decode steps calls
`init_capture` once, then for each padded batch-size bucket `bs` (and key-length bound)
captures the model's forward under the metadata from `prepare_for_capture(bs, max_seqlen_k)`;
to run a live decode step of `n <= bs` sequences it calls `prepare_for_replay(bs, meta)` and
replays that bucket's graph. A backend with `supports_graphs = False` raises
`GraphsUnsupported` from all three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from kernels.kv_write import write_kv

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (k_cache, v_cache)


class BackendState:
    """Base of the per-step state a backend precomputes in `prepare` (gather indices, masks,
    converted kernel arguments). Each backend subclasses it with typed fields."""

    __slots__ = ()


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once per step and shared by all layers.

    `slot_mapping[t]` is the flat cache slot (`block_id * block_size + offset`) that token `t`'s
    K/V is written to. Entries of `block_table[i]` past sequence `i`'s last block are padding
    and must hold a valid block id (0). `max_seqlen_q` / `max_seqlen_k` are the true maxima of
    the query and key lengths (backends trust them instead of reading tensors back to the host).
    `state` is None until a backend's `prepare` stores its precomputed state there.
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens_k: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int = 16
    state: BackendState | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_k.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class GraphsUnsupported(NotImplementedError):
    """Raised by the CUDA-graph hooks of a backend whose `supports_graphs` is False."""


StateT = TypeVar("StateT", bound=BackendState)


class AttentionBackend(ABC, Generic[StateT]):
    """A paged attention implementation.

    Instances hold no per-step data: what a step needs lives in its `AttentionMetadata`, and
    what the backend derives from it once per step lives in `meta.state` (of `state_type`).
    Graph-capture buffers, when a backend supports graphs, are the only state it owns.
    """

    name: ClassVar[str] = "abstract"
    supports_graphs: ClassVar[bool] = False
    # `write_kv` stores `k`/`v` at `slot_mapping` of `[num_blocks, block_size, kv_heads,
    # head_dim]` caches and nothing else, so the model may write them itself (RoPE fused with
    # the write, `kernels.layer_ops`) and call `attend`; False for a backend that overrides
    # `write_kv` with another layout or fuses the write into its attention
    standard_kv_write: ClassVar[bool] = True
    state_type: type[StateT]

    @classmethod
    @abstractmethod
    def why_not(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> str | None:
        """None when this backend can run here, else a short reason it cannot (for the log)."""

    @classmethod
    def supports(
        cls, *, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
    ) -> bool:
        """Whether this backend can run here (device, dtype, shapes, importable deps)."""
        return (
            cls.why_not(device=device, dtype=dtype, head_dim=head_dim, block_size=block_size)
            is None
        )

    @abstractmethod
    def build_state(self, meta: AttentionMetadata) -> StateT:
        """This step's precomputed state; may read `meta`'s tensors, never mutates them."""

    def prepare(self, meta: AttentionMetadata) -> StateT:
        """The step's state, built once into `meta.state` (idempotent: later calls reuse it).

        The model calls it once before its layers; `forward` calls it too, so a caller that
        skips it still builds the state only once per metadata object.
        """
        state = meta.state
        if not isinstance(state, self.state_type):
            state = self.build_state(meta)
            meta.state = state
        return state

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> None:
        """Store this step's `k`, `v` (`[num_tokens, kv_heads, head_dim]`) at
        `meta.slot_mapping` in the layer's caches. A backend may override it (e.g. to fuse the
        write into its kernel, or for another cache layout)."""
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_cache: KVCache,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer: write `k`/`v` into `kv_cache`, then paged causal attention of `q`.

        `q: [num_tokens, num_heads, head_dim]`; returns the same shape and dtype, written
        into `out` (and returned) when given.
        """
        self.write_kv(k, v, kv_cache, meta)
        return self.attend(q, kv_cache, meta, self.prepare(meta), scale=scale, out=out)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        state: StateT,
        *,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Paged causal attention of `q` over the cache (K/V already written)."""

    # CUDA-graph hooks. The contract a graph-capable backend implements (one that reads
    # everything from tensors derives from `kernels.graph_metadata.StaticDecodeMetadata`):
    #  * every tensor a captured kernel reads lives in a static buffer owned by the backend,
    #    allocated once in `init_capture`, so a replay sees new values at the same addresses;
    #  * captured batches are decode batches (one query per sequence) padded to a bucket size,
    #    and `max_seqlen_q` / `max_seqlen_k` of captured metadata are upper bounds;
    #  * padding sequences have key length 0 and slot -1, so they read no key and write
    #    nothing (the backend's `write_kv` skips negative slots).

    def init_capture(
        self, max_bs: int, max_blocks_per_seq: int, device: torch.device, block_size: int
    ) -> None:
        """Allocate static metadata buffers for decode batches of up to `max_bs` sequences
        with up to `max_blocks_per_seq` blocks each; called once, before any capture."""
        raise GraphsUnsupported(f"attention backend {self.name!r} does not support CUDA graphs")

    def prepare_for_capture(self, bs: int, max_seqlen_k: int) -> AttentionMetadata:
        """Metadata for capturing a decode batch of `bs` sequences of at most `max_seqlen_k`
        keys: its tensors are views of the static buffers and its `state` is prepared, so the
        captured forward does no host-side work that a replay would skip."""
        raise GraphsUnsupported(f"attention backend {self.name!r} does not support CUDA graphs")

    def prepare_for_replay(self, bs: int, meta: AttentionMetadata) -> None:
        """Copy a live decode step's metadata (`meta.num_seqs <= bs`) into bucket `bs`'s
        static buffers, padding the rest as above, before that bucket's graph is replayed."""
        raise GraphsUnsupported(f"attention backend {self.name!r} does not support CUDA graphs")
