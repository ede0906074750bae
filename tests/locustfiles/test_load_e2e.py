"""`make load` end to end (`python -m locustfiles.run`): about 15 s of load against bare mode,
which the driver starts itself on a free loopback port (nothing answers `LOAD_HOST`) and
stops afterwards. Skipped only while the demo model is not built (`make demo`)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from locustfiles.server import answers, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def demo_or_skip() -> None:
    from demo.paths import ModelNotFoundError, resolve_model

    try:
        resolve_model("demo")
    except ModelNotFoundError as exc:
        pytest.skip(f"demo model not built: {exc}")


def run_load(env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """The driver in its own process group, so that whatever it started goes with it even
    if it has to be killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "locustfiles.run"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left: the usual case
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process.returncode, output


@pytest.mark.timeout(180)
def test_load_against_bare_mode_writes_csv_and_report_per_class(tmp_path: Path) -> None:
    demo_or_skip()
    out = tmp_path / "load"
    env = {
        **os.environ,
        "LOAD_HOST": f"http://127.0.0.1:{free_port()}",  # nothing there: bare mode is started
        "LOAD_STEPS": "4,6",
        "LOAD_STEP_S": "7",
        "LOAD_OUT": str(out),
    }
    code, output = run_load(env, timeout_s=150)
    assert code == 0, output

    started = re.search(r"bare mode is up at (http://127\.0\.0\.1:\d+)", output)
    assert started, output
    assert not answers(started.group(1), timeout_s=1.0)  # stopped after the run

    with (out / "locust_stats.csv").open(newline="") as f:
        names = {row["Name"]: int(row["Request Count"]) for row in csv.DictReader(f)}
    for tier in ("interactive", "flex"):
        assert names.get(f"ttft[{tier}]", 0) > 0, names
        assert names.get(f"itl[{tier}]", 0) > 0, names

    page = (out / "report.html").read_text()
    assert "TTFT, interactive" in page and "TTFT, flex" in page
    summary = json.loads((out / "summary.json").read_text())
    for tier in ("interactive", "flex"):
        ttft = summary["classes"][tier]["ttft"]
        assert ttft["count"] > 0 and ttft["p50"] > 0
        server = summary["classes"][tier]["server"]
        assert server["requests"] > 0 and server["client_requests"] > 0
    assert f"load: report {(out / 'report.html').resolve()}" in output
