"""`bench/gpu.py --tiny` runs the GPU benchmark's whole script on the CPU (a tiny shape):
every measurement, the engine on HF-saved random weights, and the JSON it prints. (Its
figures mean nothing on the CPU; on a GPU host, `python bench/gpu.py` measures.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_bench_runs_end_to_end_on_a_tiny_shape():
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("mbu_8b_bs1", "tpot_1b_bs1_speedup_vs_hf", "throughput_8b_bs64_ratio_vs_hf",
                "prefill_mfu_8b_2k", "copy_tb_per_s", "matmul_tflop_per_s"):  # fmt: skip
        assert result[key] > 0, key
    shape = result["shapes"]["8b"]
    ours = shape["ours"]
    assert ours["kv_blocks"] > 0 and ours["backend"] == "cpu_paged" and ours["layer_ops"] == "torch"
    # the tiny shape is untied: a decode step reads all but its input embedding
    assert 0 < shape["decode_read_gb"] < shape["weights_gb"]
    assert result["floor_8b_all_weights_ms"] > result["floor_8b_ms"] > 0
    # exactly-n requests (min_tokens, ignore_eos) keep the fast paths; on the CPU nothing
    # launches ahead (async scheduling is off there)
    assert ours["launched_steps"] == 0 and ours["steps"] > 0
    assert result["gpu"] == "cpu (--tiny)"
    attention = result["attention_prefill"]  # the backend alone against torch's SDPA
    assert attention["backend"] == "cpu_paged" and attention["ours_ms"] > 0
    assert attention["sdpa_ms"] > 0
