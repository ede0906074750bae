"""The engine the GPU tests run: the tiny test model on CUDA, warmed up (graphs captured)."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from tests.engine.engine_fixture import tiny_config


def warm_gpu_engine(dtype: str, max_num_batched_tokens: int = 512, **overrides) -> LLMEngine:
    """16 seats over 512 blocks, `dtype` on the GPU, warmed up; `overrides` as tiny_config's."""
    config = tiny_config(
        device="cuda",
        dtype=dtype,
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens),
        **overrides,
    )
    engine = LLMEngine(config)
    engine.runner.warmup()
    return engine
