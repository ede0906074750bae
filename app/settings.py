"""HTTP-surface settings, read from the environment with the `FIRSTLIGHT_` prefix.

Example: `FIRSTLIGHT_PORT=9000 FIRSTLIGHT_KEEPALIVE_S=5 python -m app.standalone`.
Command-line flags of `app.standalone` override the environment.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FIRSTLIGHT_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model: str = "demo"  # EngineConfig.model: a local HF directory, or "demo"
    served_model_name: str | None = None  # the name clients send; defaults to the model's name
    device: str = "cpu"
    dtype: str = "float32"
    log_level: str = "info"

    # bodies larger than this get 413 before they are read
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # idle gap before an SSE `:` keepalive comment is sent
    keepalive_s: float = Field(default=15.0, gt=0)
    # a client that takes no bytes for this long is cut (and its request aborted)
    stall_timeout_s: float = Field(default=60.0, gt=0)
    # most choices (`n`) one request may ask for
    max_n: int = Field(default=16, ge=1)
    # distinct tag values per metric label before new ones read "other"
    max_label_values: int = Field(default=32, ge=1)
    # a name registered in policies.request_class
    request_class_policy: str = "header"
