"""Choosing the layer ops (kernels.layer_ops) on a host where the fused kernels cannot run;
test_fused_ops.py runs the kernels themselves."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.kv_write import write_kv
from kernels.layer_ops import TorchOps, select_layer_ops, smoke_check

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TRITON_INTERPRET=1 the CPU may run the kernels (test_fused_ops.py's case)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_the_cpu_gets_torchs_ops_and_the_log_says_why(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="firstlight.kernels"):
        ops = select_layer_ops(None, device=CPU, dtype=torch.float32)
    assert isinstance(ops, TorchOps)
    assert "fused kernels skipped" in caplog.text


def test_asking_for_fused_ops_where_they_cannot_run_is_an_error() -> None:
    with pytest.raises(ValueError, match="fused layer ops cannot run on device=cpu"):
        select_layer_ops(True, device=CPU, dtype=torch.float32)


def test_fused_off_by_config() -> None:
    assert isinstance(select_layer_ops(False, device=CPU, dtype=torch.float32), TorchOps)


def test_the_smoke_check_names_the_stage_that_disagrees_or_fails() -> None:
    assert smoke_check(TorchOps(), CPU, torch.float32) is None

    class Scaled(TorchOps):
        def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
            return super().silu_mul(gate_up) * 1.01

    class Raises(TorchOps):
        def rope(self, x, cos, sin):
            raise RuntimeError("no kernel image is available")

    assert (smoke_check(Scaled(), CPU, torch.float32) or "").startswith("silu_mul differs")
    assert smoke_check(Raises(), CPU, torch.float32) == "RuntimeError: no kernel image is available"


def test_the_smoke_check_compares_a_fused_rope_and_kv_write_with_rope_then_the_write() -> None:
    class Fused(TorchOps):  # torch's ops behind the fused entry point: agrees
        fuses_kv_write = True

        def rope_write_kv(self, q, k, v, cos, sin, kv_cache, slot_mapping, qk_norm=None):
            slots = self.slots(slot_mapping)
            kept = slots >= 0
            write_kv(self.rope(k, cos, sin)[kept], v[kept], *kv_cache, slots[kept])
            return self.rope(q, cos, sin)

        def slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
            return slot_mapping

    class WrongSlots(Fused):
        def slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
            return slot_mapping.flip(0)

    assert smoke_check(Fused(), CPU, torch.float32) is None
    assert (smoke_check(WrongSlots(), CPU, torch.float32) or "").startswith("rope_write_kv differs")
