"""Helpers of scripts/device_check.sh: one summary line per stage.

python scripts/device_summary.py gpu OUT/gpu.json      # bench/gpu.py's targets
python scripts/device_summary.py stream OUT/stream.txt # waits for the server on :8000,
                                                       # streams one chat, saves its lines
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

BASE = "http://127.0.0.1:8000"
TARGETS = (
    "gpu", "mbu_8b_bs1", "tpot_1b_bs1_speedup_vs_hf", "throughput_8b_bs64_ratio_vs_hf",
    "prefill_mfu_8b_2k", "prefill_mfu_8b_2k_by_params", "hf_prefill_mfu_8b_2k",
)  # fmt: skip


def gpu(path: Path) -> str:
    lines = path.read_text().strip().splitlines() if path.exists() else []
    if not lines:
        return "no JSON line (see gpu.err)"
    result = json.loads(lines[-1])
    return json.dumps({k: result.get(k) for k in TARGETS})


def stream(path: Path, wait_s: int = 100) -> str:
    """Wait for /health, stream one chat from the demo model, save the SSE data lines."""
    for _ in range(wait_s):
        try:
            if httpx.get(BASE + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        return f"no /health in {wait_s} s (see serve.log)"
    body = {
        "model": "demo",
        "stream": True,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Can I pause my annual subscription?"}],
    }
    start, first, lines = time.perf_counter(), None, []
    with httpx.stream("POST", BASE + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                first = first if first is not None else time.perf_counter() - start
                lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    done = bool(lines) and lines[-1] == "data: [DONE]"
    chunks = len(lines) - done
    ttft = f"{first:.3f} s" if first is not None else "none"
    return f"HTTP {r.status_code}, {chunks} chunks, [DONE] {done}, first chunk after {ttft}"


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    print({"gpu": gpu, "stream": stream}[kind](out))
