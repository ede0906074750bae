"""Turns one `SchedulerOutput` into logits: the only place the model and the KV cache meet.

The runner owns the per-layer KV caches (`[num_blocks, block_size, kv_heads, head_dim]`,
zero-initialised so unwritten slots are finite) and the model. `execute` packs every chunk's
tokens end to end, builds positions, slot mapping and block tables from Python lists once,
runs one forward under `torch.inference_mode()`, and returns float32 logits for the chunks
that sample, in chunk order: one row for the chunk's last real token, then one row per
draft (`spec_token_ids`, fed after the real tokens), so `k + 1` rows for `k` drafts. It
reads sequences (token ids, block ids) and never mutates them or any scheduler state; the
scheduler must already have allocated a block for every position being computed, drafts
included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.loader import ModelInfo, load_model, read_model_info
from engine.sched.output import SchedulerOutput
from kernels.interface import AttentionMetadata
from kernels.registry import select_backend


@dataclass(slots=True)
class StepInputs:
    """One step's packed inputs as plain lists (built without touching torch)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    seq_lens_k: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # packed rows of each sampling chunk's last real token and drafts


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str):
        self.config = config
        self.device = torch.device(config.device)
        info = read_model_info(model_path, config.dtype)
        self.block_size = config.cache.block_size
        self.backend = select_backend(
            config.attention_backend,
            device=self.device,
            dtype=info.dtype,
            head_dim=info.head_dim,
            block_size=self.block_size,
        )
        self.info: ModelInfo
        self.model, self.info = load_model(model_path, info.dtype, self.device, self.backend)
        self.max_model_len = config.max_model_len or self.info.max_position_embeddings
        if self.max_model_len > self.info.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"{self.info.max_position_embeddings} positions"
            )
        elem = torch.empty((), dtype=self.info.dtype).element_size()
        per_layer = self.block_size * self.info.num_kv_heads * self.info.head_dim * elem
        self.bytes_per_block = 2 * self.info.num_layers * per_layer  # K and V, every layer
        self.num_blocks = config.cache.num_blocks or (
            config.cache.kv_cache_bytes // self.bytes_per_block
        )
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes {config.cache.kv_cache_bytes} holds no block of "
                f"{self.bytes_per_block} bytes"
            )
        shape = (self.num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.info.dtype, device=self.device),
                torch.zeros(shape, dtype=self.info.dtype, device=self.device),
            )
            for _ in range(self.info.num_layers)
        ]

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """`[num_sample_rows, vocab]` float32 logits: per sampling chunk in chunk order, its
        last real token's row followed by one row per draft."""
        if out.is_empty:
            return torch.empty(0, self.info.vocab_size, dtype=torch.float32, device=self.device)
        return self._run(self.pack(out))

    def pack(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        step = StepInputs([], [], [], [0], [], [], [])
        for chunk in out.chunks:
            seq, start = chunk.seq, chunk.start
            end = start + chunk.num_tokens_with_spec
            blocks = seq.block_ids
            step.input_ids.extend(seq.token_ids[start : start + chunk.num_tokens])
            if chunk.spec_token_ids:
                step.input_ids.extend(chunk.spec_token_ids)
            step.positions.extend(range(start, end))
            step.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            step.cu_seqlens_q.append(step.cu_seqlens_q[-1] + chunk.num_tokens_with_spec)
            step.seq_lens_k.append(end)
            step.block_tables.append(blocks[: (end + bs - 1) // bs])
            if chunk.samples:
                last = step.cu_seqlens_q[-1] - 1
                step.sample_rows.extend(range(last - len(chunk.spec_token_ids), last + 1))
        return step

    def warmup(self) -> None:
        """One prefill and one decode step on the first blocks of the pool, which no request
        holds yet (so their contents don't matter), so first requests skip one-time costs."""
        bs = self.block_size
        n = max(1, min(8, self.num_blocks * bs - 1))  # prompt length; decode at position n
        blocks = list(range(min(self.num_blocks, n // bs + 1)))
        self._run(
            StepInputs([0] * n, list(range(n)), list(range(n)), [0, n], [n], [blocks], [n - 1])
        )
        if n + 1 <= self.num_blocks * bs:
            self._run(StepInputs([0], [n], [n], [0, 1], [n + 1], [blocks], [0]))

    @torch.inference_mode()
    def _run(self, step: StepInputs) -> torch.Tensor:
        dev = self.device
        width = max(len(t) for t in step.block_tables)
        table = [t + [0] * (width - len(t)) for t in step.block_tables]
        q_lens = [b - a for a, b in zip(step.cu_seqlens_q, step.cu_seqlens_q[1:], strict=False)]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(step.cu_seqlens_q, dtype=torch.int32, device=dev),
            seq_lens_k=torch.tensor(step.seq_lens_k, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=dev),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(step.seq_lens_k),
            block_size=self.block_size,
        )
        hidden = self.model(
            torch.tensor(step.input_ids, dtype=torch.int64, device=dev),
            torch.tensor(step.positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
        )
        if not step.sample_rows:
            return torch.empty(0, self.info.vocab_size, dtype=torch.float32, device=dev)
        if len(step.sample_rows) < hidden.shape[0]:
            rows = torch.tensor(step.sample_rows, dtype=torch.int64, device=dev)
            hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(hidden).float()
