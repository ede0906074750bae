"""The Triton kernels' interpreter tests (test_triton_paged.py, test_fused_ops.py, and the
decode-graph path over them, tests/engine/test_decode_graphs.py), in a process of their
own: `TRITON_INTERPRET=1` must hold from triton's first import, and in a whole-suite run
other tests import triton first (transformers' modeling code does), outside the
interpreter."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="triton is not installed (or a GPU runs test_triton_paged.py itself)",
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_kernels_match_the_reference_under_the_interpreter():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/kernels/test_triton_paged.py", "tests/kernels/test_fused_ops.py",
         "tests/engine/test_decode_graphs.py"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 55 and "skipped" not in done.stdout, tail
