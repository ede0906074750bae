"""Backend selection: by name, by priority among those that support the setup, errors, and
the log line that says why a backend was chosen over better-ranked ones."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import kernels
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
        def why_not(cls, *, device, dtype, head_dim, block_size) -> str | None:
            return None if head_dim in head_dims else f"head_dim {head_dim} not in {head_dims}"

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
    with pytest.raises(ValueError, match=r"'only128_test' does not support .*: head_dim 64 not in"):
        select_backend("only128_test", **CPU)
    with pytest.raises(ValueError, match="does not support"):
        select_backend("torch_ref", **{**CPU, "dtype": torch.int8})


def test_a_backend_needs_a_name():
    class Nameless(TorchReferenceBackend):
        name = AttentionBackend.name

    with pytest.raises(ValueError, match="must set a unique `name`"):
        register_backend()(Nameless)


def test_choice_is_logged_with_why_better_backends_were_skipped(isolated_registry, caplog):
    register_backend(priority=90)(make_backend("gpu_only_test", head_dims=(128,)))
    register_backend(priority=80)(make_backend("wide_test", head_dims=(64,)))
    with caplog.at_level(logging.INFO, logger="firstlight.kernels"):
        assert select_backend(None, **CPU).name == "wide_test"
    lines = [r.getMessage() for r in caplog.records if r.name == "firstlight.kernels"]
    assert "attention backend gpu_only_test (priority 90) skipped: head_dim 64 not in (128,)" in (
        lines
    )
    assert any(
        line.startswith("attention backend wide_test chosen for device=cpu") for line in lines
    )
    assert not any("torch_ref" in line for line in lines)  # ranked below the choice: not tried
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "firstlight.kernels")


def test_builtin_cpu_choice_explains_itself(caplog):
    with caplog.at_level(logging.INFO, logger="firstlight.kernels"):
        backend = select_backend(None, **{**CPU, "dtype": torch.bfloat16})
    assert backend.name == "torch_ref"
    text = caplog.text
    assert "cpu_paged (priority 10) skipped: dtype torch.bfloat16 is not float32" in text
    assert "attention backend torch_ref chosen for device=cpu, dtype=torch.bfloat16" in text
    with caplog.at_level(logging.INFO, logger="firstlight.kernels"):
        select_backend("torch_ref", **CPU)
    assert "attention backend torch_ref chosen by name" in caplog.text


def test_a_backend_module_that_fails_to_import_is_logged_and_skipped(
    isolated_registry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
):
    # A backend module whose optional dependency is missing, as triton or flash-attn would be.
    (tmp_path / "needs_missing_dep_test.py").write_text("import firstlight_no_such_dep_xyz\n")
    monkeypatch.setattr(kernels, "__path__", [*kernels.__path__, str(tmp_path)])
    with caplog.at_level(logging.INFO, logger="firstlight.kernels"):
        assert select_backend(None, **{**CPU, "dtype": torch.float16}).name == "torch_ref"
    assert (
        "attention backend module kernels.needs_missing_dep_test skipped: import failed: "
        "No module named 'firstlight_no_such_dep_xyz'"
    ) in caplog.text


def test_no_supporting_backend_lists_every_reason(isolated_registry, monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", {})
    register_backend(priority=3)(make_backend("a_test", head_dims=(128,)))
    register_backend(priority=2)(make_backend("b_test", head_dims=(256,)))
    with pytest.raises(
        ValueError, match=r"no attention backend supports .*a_test: head_dim 64.*b_test"
    ):
        select_backend(None, **CPU)
