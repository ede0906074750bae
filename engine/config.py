"""Engine configuration. Frozen dataclasses: change one with `dataclasses.replace`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV pool. `num_blocks` wins over `kv_cache_bytes` when both are set."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Step scheduling limits.

    `max_num_batched_tokens` is the token budget of one step (decode tokens + prefill chunks).
    `max_waiting` bounds the waiting queue: `add` past it raises `QueueFull`.
    `bulk_min_share` is the fraction of each step's token budget that bulk requests may claim
    even while interactive ones wait, so bulk never starves.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_waiting: int = 512
    bulk_min_share: float = 0.1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "demo"  # a local HF directory, or "demo" / "demo-draft" for the built-in models
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    attention_backend: str | None = None  # None picks the best that supports the setup
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
