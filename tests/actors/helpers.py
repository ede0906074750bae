"""Builders for the actors tests: a small application config and the demo-model check."""

from __future__ import annotations

from typing import Any

import pytest

from actors.settings import AppConfig
from engine.demo.paths import ModelNotFoundError, resolve_model


def require_demo_model() -> None:
    """Skip unless the demo model is built (`make demo`; `make test` builds it first)."""
    try:
        resolve_model("demo")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def small_config(**sections: Any) -> AppConfig:
    """A config sized for tests on 2 cores: a small KV pool and short queues."""
    engine = {
        "kv_cache_bytes": 8 << 20,
        "max_num_seqs": 4,
        "max_waiting": 4,
        "max_num_batched_tokens": 256,
        **sections.pop("engine", {}),
    }
    # single node: replicas reach the ingress's token channel over its Unix socket; its TCP
    # listener (for other nodes) stays on loopback in tests
    ingress = {"channel_tcp_host": "127.0.0.1", **sections.pop("ingress", {})}
    return AppConfig(engine=engine, ingress=ingress, **sections)
