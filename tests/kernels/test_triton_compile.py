"""The Triton kernels (attention, KV write, the fused layer kernels) compile for an H100
(sm_90) without one, and spill no registers.

The interpreter runs the kernels' Python, not their compilation: this compiles the launches
the backend makes with the ptxas the triton wheel ships. It runs in a subprocess because
this session's triton may be the interpreter's (see test_triton_paged.py), and this module
must not import triton itself: it is collected before that one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

ROOT = Path(__file__).resolve().parents[2]


def test_backend_launches_compile_for_sm90_without_spills(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "kernels.triton.compile_check", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    usages = json.loads(done.stdout)
    names = [u["name"] for u in usages]
    assert any("splits=1" in n for n in names) and any("combine" in n for n in names)
    assert any("rows=64" in n for n in names) and any(n.startswith("kv_write") for n in names)
    for layer_kernel in ("add_rms_norm ", "rope ", "rope_write_kv ", "rope_write_kv_qk_norm ",
                         "silu_mul "):  # fmt: skip
        assert sum(n.startswith(layer_kernel) for n in names) == 2, names  # 1B and 8B shapes
    spilled = [u for u in usages if u["stack_bytes"]]
    assert not spilled, spilled
