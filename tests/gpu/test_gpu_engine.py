"""The engine on a CUDA GPU with the settings of serve_config.gpu.yaml: device and dtype
"auto", and a KV pool sized from free GPU memory. Skipped without CUDA.

Run on a GPU host: `pytest -m gpu tests/gpu/test_gpu_engine.py`.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.runner.model_runner import ModelRunner
from tests.engine.engine_fixture import tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_places_the_engine_on_the_gpu_in_bfloat16_and_fills_the_share_of_memory():
    path = tiny_model_dir()
    util = 0.5
    config = EngineConfig(
        model=str(path),
        device="auto",
        dtype="auto",
        cache=CacheConfig(gpu_memory_utilization=util),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048),
    )
    runner = ModelRunner(config, str(path))
    assert runner.device.type == "cuda" and runner.info.dtype == torch.bfloat16
    torch.cuda.synchronize()
    _, total = torch.cuda.mem_get_info()
    pool = runner.num_blocks * runner.bytes_per_block
    assert pool > 0.3 * total  # a tiny model: nearly all of the share is KV
    assert pool + runner.bytes_per_block <= util * total  # within the share
    # the pool serves a real step (prefill, then decode) after sizing
    runner.warmup()
