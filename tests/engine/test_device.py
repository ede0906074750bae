"""Device and dtype "auto", and the KV pool's size when the config gives none."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.device import (
    CPU_KV_CACHE_BYTES,
    bind_thread,
    indexed,
    kv_budget_bytes,
    placed,
    resolve_device,
    resolve_dtype,
)
from engine.runner.model_runner import ModelRunner
from tests.engine.engine_fixture import tiny_model_dir

GIB = 1 << 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only resolution")
def test_auto_is_the_cpu_in_float32_without_a_gpu():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    config = placed(EngineConfig())
    assert (config.device, config.dtype) == ("cpu", "float32")


def test_explicit_settings_are_kept():
    config = EngineConfig(device="cpu", dtype="bfloat16")
    assert placed(config) is config
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_dtype("float16", torch.device("cpu")) == "float16"


def test_the_kv_budget_is_the_share_left_after_weights_and_activations():
    # an 80 GiB GPU at 0.9: 72 GiB, less 16 GiB of weights and 2 GiB of activations
    budget = kv_budget_bytes(
        total=80 * GIB, free=63 * GIB, weights=16 * GIB, peak_activations=2 * GIB, utilization=0.9
    )
    assert budget == 54 * GIB
    # a second replica on the same GPU (the first holds 40 GiB): at most what is free
    shared = kv_budget_bytes(
        total=80 * GIB, free=30 * GIB, weights=8 * GIB, peak_activations=2 * GIB, utilization=0.9
    )
    assert shared == 28 * GIB
    too_small = kv_budget_bytes(
        total=8 * GIB, free=GIB, weights=7 * GIB, peak_activations=GIB, utilization=0.9
    )
    assert too_small == 0


def test_without_a_size_the_cpu_pool_is_256_mib():
    path = tiny_model_dir()
    runner = ModelRunner(EngineConfig(model=str(path)), str(path))
    assert runner.device == torch.device("cpu")
    assert runner.num_blocks == CPU_KV_CACHE_BYTES // runner.bytes_per_block
    sized = ModelRunner(
        EngineConfig(model=str(path), cache=CacheConfig(kv_cache_bytes=8 << 20)), str(path)
    )
    assert sized.num_blocks == (8 << 20) // sized.bytes_per_block


def test_engine_threads_bind_an_indexed_cuda_device(monkeypatch):
    """torch's `set_device` refuses a bare "cuda" (ValueError), so the runner resolves it to
    the current device once, and each engine thread binds that index."""
    from torch.cuda._utils import _get_device_index

    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(_get_device_index(d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    cuda = indexed(torch.device("cuda"))
    assert cuda == torch.device("cuda", 2)
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")
    bind_thread(cuda)
    bind_thread(torch.device("cpu"))  # nothing
    bind_thread(torch.device("cuda"))  # a bare "cuda": the thread's own, nothing to bind
    assert bound == [2]
