"""A process that used Serve handles goes on after its Ray is shut down (tests/actors'
`serve_app` does this between modules): a task on Serve's router loop that reached Ray after
the shutdown ended the test run with status 1 in CI (`actors.serve_internals.stop_router_loop`
stops that loop first). A race: this run of the same steps passes without the fix too,
mostly; it checks the process outlives its Ray with the loop stopped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.actors.helpers import ROOT, require_demo_model

pytestmark = [pytest.mark.serve, pytest.mark.slow]

SCRIPT = """
import time
import ray
from ray import serve
from tests.actors.helpers import serve_app, small_config

with serve_app(small_config(), namespace="firstlight-teardown"):
    handle = serve.get_deployment_handle("ModelReplica", app_name="firstlight")
    handle.stats.remote().result(timeout_s=60)  # the driver's router loop starts
    # as test_serve_app's last test: the replica dies, the router meets its replacement
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                 if "ModelReplica" in a["name"])
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    handle.stats.remote().result(timeout_s=120)
time.sleep(11)  # past the router loop's periodic tasks (5 s monitor, 10 s pushes), Ray gone
print("alive after Ray", flush=True)
"""


def test_a_process_that_used_handles_outlives_its_ray() -> None:
    require_demo_model()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "alive after Ray" in done.stdout
