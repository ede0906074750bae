"""Bare mode: the OpenAI-compatible app and an in-process `AsyncEngine`, no Ray.

    python -m app.standalone [--config serve_config.yaml] [--model demo] [--port 8000] ...

Bare mode runs the same settings as Serve mode: it reads the `args` of the firstlight
application in `serve_config.yaml` (`--config`, default ./serve_config.yaml when it exists)
and the host and port its clients use (`app.settings.serve_http_address`), skipping only the
deployment sections (Serve's). Then `FIRSTLIGHT_*` environment settings apply, then the
flags that were given. The model loads before the server listens; the engine loop starts
with the app and stops with it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from fastapi import FastAPI

from app.batch.runner import BatchRunner
from app.endpoint import ModelEndpoint
from app.openai_server import build_app
from app.settings import Settings, StandaloneSettings, serve_http_address
from policies.base import create
from policies.bulk_throttle import BulkThrottle, bulk_room

DEFAULT_CONFIG = Path("serve_config.yaml")
APP_IMPORT_PATH = "actors.builder:build_app"
# `args` sections only Serve mode reads (actors.settings.AppConfig's own fields)
SERVE_ONLY_SECTIONS = ("replica", "ingress", "control_plane", "draft_replica", "batch_jobs")

_ENGINE_FLAGS = ("model", "device", "dtype")  # flags that set `engine.<name>`


def read_serve_config(path: Path) -> dict[str, Any]:
    """The firstlight application's `args` in a Serve config file, minus the Serve-only
    sections, with the `host` and `port` its clients use (`serve_http_address`)."""
    config = yaml.safe_load(path.read_text()) or {}
    apps = [a for a in config.get("applications", ()) if a.get("import_path") == APP_IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"{path}: expected one application with import_path {APP_IMPORT_PATH}")
    return {**serve_http_address(config), **bare_args(apps[0].get("args"))}


def bare_args(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """A Serve application's `args` as bare mode reads them: without the Serve-only sections."""
    return {k: v for k, v in (args or {}).items() if k not in SERVE_ONLY_SECTIONS}


def parse_settings(argv: Sequence[str] | None = None) -> StandaloneSettings:
    """`--config`'s args, then the environment, then the command-line flags that were given."""
    parser = argparse.ArgumentParser(prog="python -m app.standalone", description=__doc__)
    parser.add_argument("--config", type=Path, help="a Serve config (default ./serve_config.yaml)")
    parser.add_argument("--model", help="engine.model: a local HF model directory, or 'demo'")
    parser.add_argument("--served-model-name", help="the name clients send as `model`")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--device", help="engine.device: auto | cpu | cuda")
    parser.add_argument("--dtype", help="engine.dtype: auto | float32 | bfloat16 | float16")
    parser.add_argument("--keepalive-s", type=float)
    parser.add_argument("--log-level")
    flags = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    path = flags.pop("config", None)
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    base = read_serve_config(path) if path is not None else {}
    engine = {k: flags.pop(k) for k in _ENGINE_FLAGS if k in flags}
    if engine:
        flags["engine"] = engine
    return StandaloneSettings.layered(base, flags)


def build_standalone(settings: Settings) -> FastAPI:
    """Load the engine (slow: weights) and return the app that owns its lifecycle."""
    from demo.paths import resolve_model
    from engine.async_engine import AsyncEngine  # heavy (torch); only bare mode needs it
    from engine.process import freeze_startup_heap

    engine = AsyncEngine.from_config(
        settings.engine,
        resolve_model=resolve_model,
    )
    endpoint = ModelEndpoint(
        name=settings.served_model_name,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        client=engine,
        root=settings.engine.model,
        max_requests=settings.engine.scheduler.max_num_seqs + settings.engine.scheduler.max_waiting,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.warmup()  # as a ModelReplica does: the first request is not the warm-up
        await engine.start()
        freeze_startup_heap()
        policies = settings.policies
        throttle = create(BulkThrottle, policies.bulk_throttle, **policies.options("bulk_throttle"))
        batches = _batch_runner(
            app, lambda own: own + bulk_room(throttle, {"": engine.stats()}, own)
        )
        try:
            yield
        finally:
            if batches is not None:
                await batches.stop()
            await engine.shutdown()

    return build_app([endpoint], settings, lifespan=lifespan)


def _batch_runner(app: FastAPI, capacity: Callable[[int], int]) -> BatchRunner | None:
    """In bare mode the app's own process runs the batches (Serve mode: the BatchJobs
    deployment); it resumes whatever a previous run left unfinished."""
    state = getattr(app.state, "batch", None)
    if state is None:
        return None
    store, _ = state
    runner = BatchRunner(store, app.state.firstlight.layer, capacity)
    runner.start()
    return runner


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = build_standalone(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


if __name__ == "__main__":
    main()
