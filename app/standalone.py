"""Bare mode: the OpenAI-compatible app and an in-process `AsyncEngine`, no Ray.

    python -m app.standalone [--model demo] [--host 127.0.0.1] [--port 8000]

Flags override `FIRSTLIGHT_*` environment settings (see `app.settings.Settings`). The model
loads before the server listens; the engine loop starts with the app and stops with it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import uvicorn
from fastapi import FastAPI

from app.endpoint import ModelEndpoint
from app.openai_server import build_app
from app.settings import Settings


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Environment settings with the command-line flags that were given applied on top."""
    parser = argparse.ArgumentParser(prog="python -m app.standalone", description=__doc__)
    parser.add_argument("--model", help="a local HF model directory, or 'demo'")
    parser.add_argument("--served-model-name", help="the name clients send as `model`")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--device", help="cpu | cuda")
    parser.add_argument("--dtype", help="float32 | bfloat16 | float16")
    parser.add_argument("--keepalive-s", type=float)
    parser.add_argument("--log-level")
    flags = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    return Settings(**flags)


def build_standalone(settings: Settings) -> FastAPI:
    """Load the engine (slow: weights) and return the app that owns its lifecycle."""
    from demo.paths import resolve_model
    from engine.async_engine import AsyncEngine  # heavy (torch); only bare mode needs it
    from engine.config import EngineConfig
    from engine.process import freeze_startup_heap

    engine = AsyncEngine.from_config(
        EngineConfig(model=settings.model, device=settings.device, dtype=settings.dtype),
        stall_timeout_s=settings.stall_timeout_s,
        resolve_model=resolve_model,
    )
    endpoint = ModelEndpoint(
        name=settings.served_model_name or engine.model_name,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        client=engine,
        root=settings.model,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        freeze_startup_heap()
        try:
            yield
        finally:
            await engine.shutdown()

    return build_app([endpoint], settings, lifespan=lifespan)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = build_standalone(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


if __name__ == "__main__":
    main()
