"""Where the engine runs and in what precision, when the config says "auto", and how large a
KV pool a GPU can hold.

`placed(config)` returns the config with `device` and `dtype` made concrete for this process:
"auto" is CUDA when torch sees a GPU here (under Ray Serve: when the replica was given one,
`replica.num_gpus`), else the CPU; dtype "auto" is bfloat16 on a GPU that supports it
(float16 on one that does not) and float32 on the CPU. Everything below `LLMEngine` sees only
concrete values.

`kv_budget_bytes` is the KV pool a GPU can hold when the config gives no size: the share
`gpu_memory_utilization` of the device's memory, less this engine's weights and the
activations of the largest step (measured by one profiling forward pass: `ModelRunner`), and
never more than the memory still free less those activations (another process on the same
GPU, e.g. a second replica with `num_gpus: 0.5`, keeps what it holds).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import EngineConfig

CPU_KV_CACHE_BYTES = 256 * 1024 * 1024  # the pool on the CPU when the config gives no size


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def placed(config: EngineConfig) -> EngineConfig:
    """`config` with a concrete device and dtype (unchanged when both already are)."""
    if config.device != "auto" and config.dtype != "auto":
        return config
    device = resolve_device(config.device)
    return replace(config, device=str(device), dtype=resolve_dtype(config.dtype, device))  # type: ignore[arg-type]


def kv_budget_bytes(
    *,
    total: int,
    free: int,
    weights: int,
    peak_activations: int,
    utilization: float,
) -> int:
    """Bytes the KV pool may take on a device of `total` bytes with `free` bytes free now:
    `utilization` of it less the weights and the largest step's activations, and at most what
    is free less those activations. Never negative."""
    share = int(total * utilization) - weights - peak_activations
    return max(0, min(share, free - peak_activations))


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" is the current device of the calling thread,
    which another thread's "cuda" need not be, so an engine resolves it once, where it is
    built."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def bind_thread(device: torch.device) -> None:
    """Make `device` (indexed: `indexed`) the calling thread's current CUDA device (nothing
    on the CPU). CUDA's current device is per thread and starts at 0; Triton launches on it
    and events record on its stream, so every thread that runs an engine on `cuda:N` calls
    this first. A bare "cuda" means the thread's current device: nothing to bind (and torch's
    `set_device` refuses it)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
