"""Builders for the actors tests: a small application config and the demo-model check."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.settings import AppConfig
from app.settings import deep_merge
from demo.paths import ModelNotFoundError, resolve_model


def require_demo_model() -> None:
    """Skip unless the demo model is built (`make demo`; `make test` builds it first)."""
    try:
        resolve_model("demo")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def small_config(**sections: Any) -> AppConfig:
    """A config sized for tests on 2 cores: a small KV pool and short queues."""
    engine = deep_merge(
        {
            "cache": {"kv_cache_bytes": 8 << 20},
            "scheduler": {"max_num_seqs": 4, "max_waiting": 4, "max_num_batched_tokens": 256},
        },
        sections.pop("engine", {}),
    )
    # single node: replicas reach the ingress's token channel over its Unix socket; its TCP
    # listener (for other nodes) stays on loopback in tests
    ingress = {"channel_tcp_host": "127.0.0.1", **sections.pop("ingress", {})}
    return AppConfig(engine=engine, ingress=ingress, **sections)


ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppURL(str):
    """The base URL clients use (the Ingress's own HTTP server: Serve's direct ingress), with
    `.proxy`, the same application through Serve's proxy (the fallback)."""

    proxy: str


@contextlib.contextmanager
def serve_app(config: AppConfig, namespace: str) -> Iterator[AppURL]:
    """The application on a real, private Ray (127.0.0.1, 2 CPUs) with the controller options
    of serve_config.yaml, on free ports; yields its URLs once it answers and shuts Ray down
    (its own processes) after."""
    require_demo_model()
    import ray
    from ray import serve

    from actors.builder import application
    from actors.serve_internals import stop_router_loop, with_ingress_port
    from app.playground.announce import wait_until_up

    port = proxy_port = free_port()
    while proxy_port == port:
        proxy_port = free_port()
    controller = with_ingress_port(
        yaml.safe_load((ROOT / "serve_config.yaml").read_text())["controller_options"], port
    )
    temp_dir = tempfile.mkdtemp(prefix="fl-test-ray-")
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), old_path]))
    ray.init(
        address="local",
        namespace=namespace,
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
    )
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": proxy_port}, controller_options=controller
        )
        serve.run(application(config), name="firstlight", route_prefix="/")
        url = AppURL(f"http://127.0.0.1:{port}")
        url.proxy = f"http://127.0.0.1:{proxy_port}"
        assert wait_until_up(url, timeout_s=30), f"{url}/health never answered"
        yield url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        stop_router_loop()  # else a task on it may end this process once Ray is gone
        ray.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
        shutil.rmtree(temp_dir, ignore_errors=True)
