"""Backend selection: by name, by priority among those that support the setup, and errors."""

from __future__ import annotations

import pytest
import torch

from kernels import registry
from kernels.interface import AttentionBackend
from kernels.reference import TorchReferenceBackend
from kernels.registry import available_backends, register_backend, select_backend

CPU = dict(device="cpu", dtype=torch.float32, head_dim=64, block_size=16)


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register test backends into a copy, so other tests see the real registry."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))


def make_backend(name: str, *, head_dims: tuple[int, ...]) -> type[AttentionBackend]:
    class Fake(TorchReferenceBackend):
        @classmethod
        def supports(cls, *, device, dtype, head_dim, block_size) -> bool:
            return head_dim in head_dims

    Fake.name = name
    return Fake


def test_reference_is_available_and_picked_on_cpu():
    assert "torch_ref" in available_backends()
    backend = select_backend(None, **CPU)
    assert isinstance(backend, TorchReferenceBackend)
    assert isinstance(select_backend("torch_ref", **CPU), TorchReferenceBackend)


def test_highest_priority_supported_backend_wins(isolated_registry):
    fast = make_backend("fast_test", head_dims=(128,))
    assert register_backend(priority=50)(fast) is fast  # the decorator returns what it wraps
    register_backend(priority=20)(make_backend("medium_test", head_dims=(64, 128)))
    assert select_backend(None, **{**CPU, "head_dim": 128}).name == "fast_test"
    assert select_backend(None, **CPU).name == "medium_test"  # fast_test lacks head_dim 64
    # bf16 on CPU: only the reference applies among the built-ins (cpu_paged is float32)
    bf16 = {**CPU, "head_dim": 80, "dtype": torch.bfloat16}
    assert select_backend(None, **bf16).name == "torch_ref"
    assert available_backends()["fast_test"] == 50


def test_unknown_or_unsupported_names_raise(isolated_registry):
    register_backend(priority=5)(make_backend("only128_test", head_dims=(128,)))
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend("nope", **CPU)
    with pytest.raises(ValueError, match="'only128_test' does not support"):
        select_backend("only128_test", **CPU)
    with pytest.raises(ValueError, match="does not support"):
        select_backend("torch_ref", **{**CPU, "dtype": torch.int8})


def test_a_backend_needs_a_name():
    class Nameless(TorchReferenceBackend):
        name = AttentionBackend.name

    with pytest.raises(ValueError, match="must set a unique `name`"):
        register_backend()(Nameless)
