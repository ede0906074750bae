"""The CLI streams a real answer from the demo model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from demo.paths import ModelNotFoundError, resolve_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cli_streams_an_answer_from_the_demo_model() -> None:
    try:
        resolve_model("demo")
    except ModelNotFoundError:
        pytest.skip("demo model not built (make demo)")
    proc = subprocess.run(
        [sys.executable, "-m", "engine.generate", "--model", "demo",
         "Can I pause my annual subscription?"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "pause" in proc.stdout.lower()
    assert "subscription" in proc.stdout.lower()
    assert "[stop;" in proc.stderr and "TTFT" in proc.stderr
