"""A real two-node Ray cluster on this machine (two raylets), started by
`scripts/two_node.sh up` exactly as the README says, with serve_config.yaml deployed by
`serve deploy`: model replicas on the second node, everything else on the head, tokens
streamed from the second node over the token channel's TCP path; `down` leaves no process.

The cluster has its own temp dir and a block of free ports, so it never meets another Ray on
this machine; tests run in file order and the last one stops it."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.actors.helpers import require_demo_model
from tests.app.helpers import parse_sse
from tests.scripts.helpers import SCRIPT, two_node

pytestmark = [pytest.mark.serve, pytest.mark.slow]

# GCS .. node2's runtime-env agent (+18); the worker ranges are +100..+299. HTTP on +300 and
# Serve's fallback proxy on HTTP + 100 (scripts/two_node.py), clear of the worker ranges.
HTTP_OFFSET = 300
PORTS = [*range(19), HTTP_OFFSET, HTTP_OFFSET + 100]
HEAD_ACTORS = {"ServeController", "ProxyActor"} | {
    f"ServeReplica:firstlight:{name}"
    for name in ("Ingress", "ControlPlane", "DraftReplica", "BatchJobs")
}


def free_port_block() -> int:
    """A base port whose `PORTS` (offsets) are free on every interface (Ray's GCS and
    raylets listen on all of them), with its worker ranges (+100..+299) clear of Ray's
    default 10002-19999 and of the kernel's ephemeral ports."""
    for _ in range(50):
        base = random.randrange(20000, 32000, 500)
        try:
            for port in (base + offset for offset in PORTS):
                with socket.socket() as s:
                    s.bind(("", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no block of free ports")


@dataclass
class Cluster:
    directory: Path
    port: int
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port + HTTP_OFFSET}"

    def state(self, kind: str) -> list[dict[str, Any]]:
        """Ray's state API (`/api/v0/nodes`, `/api/v0/actors`), with the cluster's token."""
        token = (self.directory / "auth_token").read_text().strip()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port + 1}/api/v0/{kind}?detail=true&limit=1000",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)["data"]["result"]["result"]

    def script(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(SCRIPT), command],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    require_demo_model()
    directory = Path(tempfile.mkdtemp(prefix="fl-2n-", dir="/tmp"))
    port = free_port_block()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "FL_"))}
    env.update(
        FL_CLUSTER_DIR=str(directory),
        FL_PORT=str(port),
        FL_HTTP_PORT=str(port + HTTP_OFFSET),
        FL_WAIT_S="150",
    )
    cluster = Cluster(directory, port, env)
    try:
        up = cluster.script("up", timeout=210)
        if up.returncode != 0:
            pytest.fail(f"two_node.sh up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
        yield cluster
    finally:
        cluster.script("down", timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


def test_model_replicas_run_on_the_second_node_and_the_rest_on_the_head(cluster):
    nodes = [n for n in cluster.state("nodes") if n["state"] == "ALIVE"]
    assert len(nodes) == 2
    (head,) = (n["node_id"] for n in nodes if "head" in n["resources_total"])
    (node2,) = (n["node_id"] for n in nodes if "node2" in n["resources_total"])
    actors = [a for a in cluster.state("actors") if a["state"] == "ALIVE"]
    where = {a["class_name"]: a["node_id"] for a in actors if a["class_name"] in HEAD_ACTORS}
    assert where == dict.fromkeys(HEAD_ACTORS, head)
    replicas = [a for a in actors if a["class_name"] == "ServeReplica:firstlight:ModelReplica"]
    assert replicas and all(a["node_id"] == node2 for a in replicas)


async def test_tokens_stream_from_the_second_node_over_tcp(cluster):
    body = {
        "model": "demo",
        "stream": True,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Can I pause my annual subscription?"}],
    }
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
        metrics = (await client.get("/metrics")).text
    events = parse_sse(raw)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert len(events) >= 2 and text.strip()
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    connections = {
        sample.labels["transport"]: sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "firstlight_token_channel_connections"
        for sample in family.samples
    }
    # the replica on node2 reached the ingress on the head over TCP, never its Unix socket
    assert connections["tcp"] >= 1 and connections["unix"] == 0


def test_down_stops_every_process_of_the_cluster(cluster):
    assert two_node().cluster_processes(cluster.directory, cluster.port)  # running until now
    down = cluster.script("down", timeout=60)
    assert down.returncode == 0, down.stderr
    assert two_node().cluster_processes(cluster.directory, cluster.port) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(cluster.url + "/health", timeout=5)
