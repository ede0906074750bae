"""Turns one `SchedulerOutput` into logits: the only place the model and the KV cache meet.

The runner owns the per-layer KV caches (`[num_blocks, block_size, kv_heads, head_dim]`,
zero-initialised so unwritten slots are finite) and the model. `execute` packs every chunk's
tokens end to end into plain lists once (`pack`), writes them into the persistent input
buffers allocated at start-up (`engine.runner.inputs.StepBuffers`: no tensor is built from a
list per step, and input addresses stay fixed, as CUDA graphs need), runs one forward under
`torch.inference_mode()`, and returns float32 logits for the chunks that sample, in chunk
order: one row for the chunk's last real token, then one row per draft (`spec_token_ids`,
fed after the real tokens), so `k + 1` rows for `k` drafts. It reads sequences (token ids,
block ids) and never mutates them or any scheduler state; the scheduler must already have
allocated a block for every position being computed, drafts included.

A step launched before the previous one's tokens were read back (the engine's
`async_scheduling`) has sequences whose last token is `PLACEHOLDER`: `execute` takes `feed`
(the previous step's sampling row of each request, and its token tensor on the device) and
writes those inputs on the device, after the host buffers were copied in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from engine.config import EngineConfig
from engine.device import CPU_KV_CACHE_BYTES, bind_thread, indexed, kv_budget_bytes, placed
from engine.models.loader import ModelInfo, load_model, read_model_info
from engine.request import SamplingParams
from engine.runner.graphs import DecodeGraphs
from engine.runner.inputs import StepBuffers, StepInputs
from engine.sample.filters import draw
from engine.sample.filters import weights as sample_weights
from engine.sched.output import SchedulerOutput
from engine.sequence import PLACEHOLDER
from kernels.interface import AttentionMetadata
from kernels.registry import select_backend

logger = logging.getLogger(__name__)

# The previous step's sampling row per request id, and its sampled tokens on the device.
Feed = tuple[Mapping[str, int], torch.Tensor]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str):
        config = placed(config)
        self.config = config
        self.device = indexed(torch.device(config.device))
        bind_thread(self.device)
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
        self.model, self.info = load_model(
            model_path, info.dtype, self.device, self.backend, config.fused_ops
        )
        self.ops = self.model.ops
        self.max_model_len = config.max_model_len or self.info.max_position_embeddings
        if self.max_model_len > self.info.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"{self.info.max_position_embeddings} positions"
            )
        elem = torch.empty((), dtype=self.info.dtype).element_size()
        per_layer = self.block_size * self.info.num_kv_heads * self.info.head_dim * elem
        self.bytes_per_block = 2 * self.info.num_layers * per_layer  # K and V, every layer
        self.buffers = StepBuffers(
            max_num_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
        )
        cache = config.cache
        if cache.num_blocks:
            self.num_blocks = cache.num_blocks
        elif cache.kv_cache_bytes is not None or self.device.type != "cuda":
            self.num_blocks = (cache.kv_cache_bytes or CPU_KV_CACHE_BYTES) // self.bytes_per_block
        else:
            self.num_blocks = self._blocks_from_free_memory()
        if self.num_blocks < 1:
            raise ValueError(
                f"the KV pool (kv_cache_bytes {cache.kv_cache_bytes}, gpu_memory_utilization "
                f"{cache.gpu_memory_utilization}) holds no block of {self.bytes_per_block} bytes"
            )
        self.kv_caches = self._allocate_kv(self.num_blocks)
        self.graphs: DecodeGraphs | None = None  # captured by `warmup` on CUDA

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.info.dtype, device=self.device),
                torch.zeros(shape, dtype=self.info.dtype, device=self.device),
            )
            for _ in range(self.info.num_layers)
        ]

    def _largest_step(self) -> tuple[StepInputs, int]:
        """The step that profiles the activations' peak, and the KV blocks it writes: the
        full token budget, in sequences of at most `max_model_len - 1` tokens (at most
        `max_num_seqs` of them), with a full batch of logits rows (each sequence's drafts
        too, when the engine speculates)."""
        step_tokens = self.config.scheduler.max_num_batched_tokens
        longest = max(1, min(step_tokens, self.max_model_len - 1))
        lengths = [longest] * (step_tokens // longest)
        lengths += [step_tokens % longest] if step_tokens % longest else []
        lengths = lengths[: self.config.scheduler.max_num_seqs]
        bs = self.block_size
        step = StepInputs([], [], [], [0], [], [], [])
        num_blocks = 0
        for n in lengths:
            blocks = list(range(num_blocks, num_blocks + -(-(n + 1) // bs)))
            num_blocks += len(blocks)
            step.input_ids.extend([0] * n)
            step.positions.extend(range(n))
            step.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(n))
            step.cu_seqlens_q.append(step.cu_seqlens_q[-1] + n)
            step.seq_lens_k.append(n)
            step.block_tables.append(blocks)
        num_tokens = step.cu_seqlens_q[-1]
        spec = self.config.speculative
        per_seq = 1 + (spec.max_num_tokens if spec.method != "off" else 0)  # drafts verified
        rows = min(num_tokens, self.config.scheduler.max_num_seqs * per_seq)
        step.sample_rows.extend(range(num_tokens - rows, num_tokens))
        return step, num_blocks

    def _profile_run(self, step: StepInputs) -> torch.Tensor:
        """The step's forward, then a top-k/top-p/min-p draw for each of its logits rows."""
        logits = self._run(step)
        rows = logits.shape[0]
        sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01)
        u = torch.rand(rows, 1, device=self.device)
        return draw(sample_weights(logits, [sampled] * rows), u)

    def _blocks_from_free_memory(self) -> int:
        """On CUDA with no size given: the blocks `gpu_memory_utilization` of the device
        leaves after the largest step's peak, measured on a scratch pool just large enough:
        a prefill of the full step budget (`max_num_batched_tokens` tokens, in sequences of
        at most `max_model_len - 1`), then a top-k/top-p/min-p draw over the logits of a full
        batch (`max_num_seqs` rows: the sampler's sort and masks are the step's other peak)."""
        step, num_blocks = self._largest_step()
        torch.cuda.synchronize(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        self.kv_caches = self._allocate_kv(num_blocks)
        scratch = torch.cuda.memory_allocated(self.device) - weights
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(step)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - weights - scratch
        del self.kv_caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget_bytes(
            total=total,
            free=free,
            weights=weights,
            peak_activations=peak,
            utilization=self.config.cache.gpu_memory_utilization,
        )
        return budget // self.bytes_per_block

    def execute(
        self,
        out: SchedulerOutput,
        interrupt: Callable[[], bool] | None = None,
        feed: Feed | None = None,
    ) -> torch.Tensor:
        """`[num_sample_rows, vocab]` float32 logits: per sampling chunk in chunk order, its
        last real token's row followed by one row per draft. With `interrupt`, the pass may
        stop before a layer or its MLP (`StepInterrupted`, see the model's forward). `feed`
        gives the tokens of `PLACEHOLDER` inputs (module doc)."""
        if out.is_empty:
            return torch.empty(0, self.info.vocab_size, dtype=torch.float32, device=self.device)
        step = self.pack(out, feed[0] if feed is not None else None)
        return self._run(step, interrupt, feed[1] if feed is not None else None)

    def pack(self, out: SchedulerOutput, feed_rows: Mapping[str, int] | None = None) -> StepInputs:
        bs = self.block_size
        step = StepInputs([], [], [], [0], [], [], [])
        for chunk in out.chunks:
            seq, start = chunk.seq, chunk.start
            end = start + chunk.num_tokens_with_spec
            blocks = seq.block_ids
            tokens = seq.token_ids[start : start + chunk.num_tokens]
            if feed_rows is not None and tokens[-1] == PLACEHOLDER:  # only ever the last
                step.feed_dst.append(len(step.input_ids) + len(tokens) - 1)
                step.feed_src.append(feed_rows[seq.request_id])
            step.input_ids.extend(tokens)
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
        bind_thread(self.device)  # callers may run this on a worker thread
        bs = self.block_size
        n = max(1, min(8, self.num_blocks * bs - 1))  # prompt length; decode at position n
        blocks = list(range(min(self.num_blocks, n // bs + 1)))
        self._run(
            StepInputs([0] * n, list(range(n)), list(range(n)), [0, n], [n], [blocks], [n - 1])
        )
        if n + 1 <= self.num_blocks * bs:
            self._run(StepInputs([0], [n], [n], [0, 1], [n + 1], [blocks], [0]))
        if (
            self.config.cuda_graphs
            and self.device.type == "cuda"
            and self.backend.supports_graphs
            and self.graphs is None
        ):
            try:
                self.capture_graphs()  # sets `self.graphs` only once every graph is captured
            except Exception:  # a replica that runs eagerly beats one that does not start
                logger.exception("capturing CUDA graphs failed; decode steps run eagerly")

    def capture_graphs(self, *, capture: bool = True) -> DecodeGraphs:
        """Capture the decode graphs (`engine.runner.graphs`); from now on decode steps replay
        them. `capture=False` builds the same static path without CUDA graphs (CPU tests)."""
        sched = self.config.scheduler
        graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_caches,
            self.buffers,
            max_batch=min(sched.max_num_seqs, sched.max_num_batched_tokens),
            max_model_len=self.max_model_len,
            dtype=self.info.dtype,
            capture=capture,
        )
        graphs.capture_all()
        self.graphs = graphs
        return graphs

    def _replay(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states from a decode graph, or None where none runs it. A
        graph that fails turns the graphs off: this step and the rest run eagerly."""
        graphs = self.graphs
        if graphs is None or (graph := graphs.lookup(meta)) is None:
            return None
        try:
            return graphs.run(graph, meta)
        except Exception:
            logger.exception("a decode graph failed; decode steps run eagerly from now on")
            self.graphs = None
            return None

    @torch.inference_mode()
    def _run(
        self,
        step: StepInputs,
        interrupt: Callable[[], bool] | None = None,
        fed_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = self.buffers.fill(step)
        if inputs.feed is not None:
            assert fed_tokens is not None
            dst, src = inputs.feed
            # A draw outside the vocabulary (non-finite logits) fails its request when read
            # back; clamped here, so it never indexes past the embedding meanwhile.
            tokens = fed_tokens.index_select(0, src).clamp_(0, self.info.vocab_size - 1)
            inputs.input_ids.index_copy_(0, dst, tokens)
        hidden = self._replay(inputs.meta)  # a decode step: one replay, never interrupted
        if hidden is None:
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, interrupt
            )
        if not step.sample_rows:
            return torch.empty(0, self.info.vocab_size, dtype=torch.float32, device=self.device)
        if len(step.sample_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, inputs.sample_rows)
        return self.model.compute_logits(hidden).float()
