"""Engine configuration. Frozen dataclasses: change one with `dataclasses.replace`.

This is the only definition of the engine's settings: `serve_config.yaml`'s `engine:` section
(Serve and bare mode alike) is validated into these classes with the same nesting, field by
field (app/config_schema.py). A field's `metadata` holds its validation bounds (`ge`, `gt`,
`le`, `lt`), in the spelling of pydantic's `Field`; the engine itself never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV pool. `num_blocks` wins over `kv_cache_bytes` when both are set. With
    neither, the pool is 256 MiB on the CPU, and on a GPU what `gpu_memory_utilization` of its
    memory leaves after the weights and the largest step's activations (engine/device.py)."""

    block_size: int = field(default=16, metadata={"ge": 1})
    num_blocks: int | None = field(default=None, metadata={"ge": 1})
    kv_cache_bytes: int | None = field(default=None, metadata={"ge": 1024 * 1024})
    gpu_memory_utilization: float = field(default=0.9, metadata={"gt": 0.0, "le": 1.0})
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Step scheduling limits and order.

    `max_num_batched_tokens` is the token budget of one step (decode tokens + prefill chunks).
    `max_waiting` bounds the waiting queue: past it `AsyncEngine`'s admission
    (engine/sched/admission.py) answers `QueueFull` with a Retry-After from the drain rate.
    `policy` names the step order (policies/step_order.py): "priority" (interactive first,
    bulk aged by `aging_s`; None: strict), "fcfs" (arrival order, classes alike) or
    "deadline" (earliest of arrival + `interactive_ttft_s` / `bulk_ttft_s` and the request's
    own deadline first). Under a class-aware order (priority, deadline), `bulk_min_share` is
    the fraction of each step's token budget and seats that bulk requests may claim even
    while interactive ones wait, so bulk never starves; fcfs reserves nothing.
    """

    max_num_batched_tokens: int = field(default=2048, metadata={"ge": 16})
    max_num_seqs: int = field(default=64, metadata={"ge": 1})
    max_waiting: int = field(default=512, metadata={"ge": 1})
    bulk_min_share: float = field(default=0.1, metadata={"ge": 0.0, "le": 1.0})
    # Waiting places only interactive requests may take (None: a quarter of max_waiting):
    # a flood of bulk never gets an interactive request refused (engine/sched/admission.py).
    interactive_reserve: int | None = field(default=None, metadata={"ge": 0})
    policy: str = "priority"
    aging_s: float | None = field(default=30.0, metadata={"ge": 0.0})
    # Under a class-aware order, a step that yields an interactive request's first token
    # carries no bulk chunks, unless the step before it left bulk out too (so bulk still
    # runs at least every other step): bulk rows never lengthen the step a chat's TTFT ends
    # with. Their chunks come again in the next step.
    first_token_alone: bool = True
    interactive_ttft_s: float = field(default=1.0, metadata={"ge": 0.0})
    bulk_ttft_s: float = field(default=30.0, metadata={"ge": 0.0})


SpecMethod = Literal["off", "prompt_lookup", "draft_model"]


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/). `method`: "off"; "prompt_lookup" (n-gram matches
    in the sequence's own tokens, no model); "draft_model" (`draft_model` in this process,
    with its own KV pool of `draft_kv_cache_bytes`; under Serve a `DraftReplica` can serve
    the drafts instead, see actors/settings.py). `policy` names the speculation-length policy
    (policies/speculation.py) that picks 0..`max_num_tokens` drafts per sequence and step.
    `bulk`: whether bulk requests get drafts too. Off by default: speculation spends compute
    to cut the time per token, which bulk work does not ask for, and under a bulk batch's
    large batches it costs throughput (measured: a 2,000-line batch through Serve ran at 0.81
    of the engine alone with bulk drafts, 1.03 without)."""

    method: SpecMethod = "off"
    draft_model: str = "demo-draft"
    max_num_tokens: int = field(default=8, metadata={"ge": 1, "le": 8})
    policy: str = "adaptive"
    draft_kv_cache_bytes: int = field(default=32 * 1024 * 1024, metadata={"ge": 1024 * 1024})
    prompt_lookup_min_ngram: int = field(default=1, metadata={"ge": 1})
    prompt_lookup_max_ngram: int = field(default=3, metadata={"ge": 1})
    bulk: bool = False


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """`stall_timeout_s`: a request whose output sits unread this long is aborted (read by
    `AsyncEngine`)."""

    model: str = "demo"  # a local HF directory, or "demo" / "demo-draft" for the built-in models
    # "auto": CUDA when this process sees a GPU, else the CPU; bfloat16 on a GPU, float32 on
    # the CPU (engine/device.py; serve_config.gpu.yaml uses it). The defaults stay on the CPU,
    # so a CPU config means the same on a host that has a GPU.
    dtype: Dtype = "float32"
    device: str = "cpu"
    # defaults to the model's max_position_embeddings
    max_model_len: int | None = field(default=None, metadata={"ge": 16})
    attention_backend: str | None = None  # None picks the best that supports the setup
    seed: int = 0
    stall_timeout_s: float = field(default=30.0, metadata={"gt": 0})
    # Grammar-constrained requests verify the tokens their grammar forces as drafts, several
    # per step (engine.structured.masks); off: one forward pass per token, as for free text.
    jump_forward: bool = True
    # A step that serves only bulk work stops before its next layer or MLP when an interactive
    # request arrives, and runs again with it (engine.llm_engine.LLMEngine.step): chat never waits
    # out a bulk step. The stopped part is recomputed (at most one step per arrival).
    interrupt_bulk_steps: bool = True
    # For this long after the engine last held an interactive request, a step that serves only
    # bulk work runs on a thread at the OS's idle CPU priority (engine.idle_runner.IdleRunner):
    # any other runnable thread on the host, the chat's own way through the ingress and Serve
    # included, takes the CPU from it at once. Past it (a batch alone) bulk steps run at normal
    # priority. 0: off. CPU engines only (a GPU step's CPU time is launches the GPU waits on).
    bulk_idle_priority_s: float = field(default=5.0, metadata={"ge": 0})
    # CUDA engines: decode steps (one token per sequence, up to max_num_seqs sequences) replay
    # CUDA graphs captured at warm-up when the attention backend supports them
    # (engine.runner.graphs); off: every step launches its kernels one by one.
    cuda_graphs: bool = True
    # The layers' element-wise stages (residual add + RMSNorm, RoPE, SiLU-and-multiply) as
    # one fused Triton kernel each (kernels.layer_ops) instead of about twenty torch ops a
    # layer. None: fused where the kernels run (CUDA) and pass a start-up check against
    # torch's ops; True: fused or an error; False: torch's ops.
    fused_ops: bool | None = None
    # A step is launched before the previous step's tokens are read back, its inputs for those
    # tokens taken from the device (engine.ahead): the host's work between
    # steps (outputs, scheduling, input preparation) runs while the device computes. A
    # sequence that stopped wastes one row of the step after. Applies to steps whose rows need
    # no token history (no penalties, logprobs, min_tokens ban, grammar) in engines that do
    # not speculate; other steps run as before. None: on for CUDA engines, off on the CPU
    # (where the forward pass holds the thread, so launching ahead only delays outputs).
    async_scheduling: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
