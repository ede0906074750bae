"""The steps of `scripts/two_node.sh` that are easier in Python than in a shell.

python scripts/two_node.py token PATH
    A Ray authentication token for this cluster only (mode 0600), unless PATH has one.
python scripts/two_node.py config SRC DST --http-port PORT
    DST: serve_config.yaml SRC with the two-node placement: model replicas need the
    `node2` resource, every other deployment the `head` resource. Everything firstlight
    listens on is 127.0.0.1: HTTP on PORT (Serve's fallback proxy on PORT + 100), the token
    channel's and the DraftReplica's TCP listeners (the nodes share the host's loopback).
python scripts/two_node.py wait --http-port PORT --dashboard-port PORT [--timeout-s S]
    Until GET /health answers 200 (the ingress is up, so a model replica is); fails at
    once when Serve reports the application DEPLOY_FAILED, with Serve's message. Reads
    the dashboard with the token at $RAY_AUTH_TOKEN_PATH.
python scripts/two_node.py stop DIR --gcs-port PORT
    Stops the Ray processes of the cluster whose temp dirs are under DIR, and only those:
    each Ray daemon names its temp dir on its command line (but the Ray client server,
    which names its GCS address), and the workers are their children. (`ray stop` would
    stop every Ray on this machine.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.serve_internals import with_ingress_port

HEAD = {"head": 0.01}
NODE2 = {"node2": 0.01}
HEAD_SECTIONS = ("ingress", "control_plane", "draft_replica", "batch_jobs")


def two_node_config(config: dict[str, Any], http_port: int) -> dict[str, Any]:
    """`config` (a parsed serve_config.yaml) with the two-node placement, firstlight's
    listeners on 127.0.0.1, and HTTP on `http_port` (the Ingress's own server; Serve's
    fallback proxy on `http_port + 100`, as 8000 and 8100 in serve_config.yaml)."""
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1"}
    config["http_options"]["port"] = http_port + 100
    config["controller_options"] = with_ingress_port(config.get("controller_options"), http_port)
    for app in config["applications"]:
        args = app.setdefault("args", {})
        args.setdefault("replica", {})["resources"] = NODE2
        for section in HEAD_SECTIONS:
            args.setdefault(section, {})["resources"] = HEAD
        args["ingress"]["channel_tcp_host"] = "127.0.0.1"
        args["draft_replica"]["host"] = "loopback"
    return config


def write_token(path: Path) -> None:
    if path.is_file() and path.read_text().strip():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes


def write_config(src: Path, dst: Path, http_port: int) -> None:
    config = two_node_config(yaml.safe_load(src.read_text()), http_port)
    dst.parent.mkdir(parents=True, exist_ok=True)
    header = f"# {src} placed on two nodes by scripts/two_node.py (do not edit)\n"
    dst.write_text(header + yaml.safe_dump(config, sort_keys=False))


def _get(url: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token_path:
        request.add_header("Authorization", f"Bearer {Path(token_path).read_text().strip()}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def wait(http_port: int, dashboard_port: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    status = "NOT_STARTED"
    while time.monotonic() < deadline:
        if _get(f"http://127.0.0.1:{http_port}/health")[0] == 200:
            print(f"firstlight answers on http://127.0.0.1:{http_port}/")
            return 0
        code, body = _get(f"http://127.0.0.1:{dashboard_port}/api/serve/applications/")
        if code == 200:
            app = json.loads(body).get("applications", {}).get("firstlight", {})
            status = app.get("status", status)
            if status == "DEPLOY_FAILED":
                print(f"firstlight failed to deploy: {app.get('message')}", file=sys.stderr)
                return 1
        time.sleep(1.0)
    print(f"firstlight not up after {timeout_s:.0f} s (Serve: {status})", file=sys.stderr)
    return 1


def cluster_processes(directory: Path, gcs_port: int) -> list[psutil.Process]:
    """The Ray processes of the cluster whose temp dirs are in `directory` and whose GCS
    listens on `gcs_port`, with all their descendants (never this process or its callers)."""
    marker = str(directory.resolve())
    me = psutil.Process()
    spared = {me.pid} | {p.pid for p in me.parents()}
    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid in spared:
            continue
        # the directory itself or a path in it, never a sibling that shares its prefix
        names_dir = any(marker + os.sep in arg or arg.endswith(marker) for arg in cmdline)
        client_server = "ray.util.client.server" in cmdline and any(
            arg.startswith("--address=") and arg.endswith(f":{gcs_port}") for arg in cmdline
        )
        if names_dir or client_server:
            roots.append(proc)
    found = {p.pid: p for p in roots}
    for proc in roots:
        with contextlib.suppress(psutil.Error):
            found.update((child.pid, child) for child in proc.children(recursive=True))
    return [p for pid, p in found.items() if pid not in spared]


def stop(directory: Path, gcs_port: int, grace_s: float = 10.0) -> int:
    procs = cluster_processes(directory, gcs_port)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    print(f"stopped {len(procs)} processes of the cluster in {directory}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("token").add_argument("path", type=Path)
    config = sub.add_parser("config")
    config.add_argument("src", type=Path)
    config.add_argument("dst", type=Path)
    config.add_argument("--http-port", type=int, required=True)
    waiting = sub.add_parser("wait")
    waiting.add_argument("--http-port", type=int, required=True)
    waiting.add_argument("--dashboard-port", type=int, required=True)
    waiting.add_argument("--timeout-s", type=float, default=300.0)
    stopping = sub.add_parser("stop")
    stopping.add_argument("directory", type=Path)
    stopping.add_argument("--gcs-port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "token":
        write_token(args.path)
        return 0
    if args.command == "config":
        write_config(args.src, args.dst, args.http_port)
        return 0
    if args.command == "wait":
        return wait(args.http_port, args.dashboard_port, args.timeout_s)
    return stop(args.directory, args.gcs_port)


if __name__ == "__main__":
    sys.exit(main())
