"""What both modes share: the HTTP surface, the engine and the policy names.

The same `serve_config.yaml` `args` configure Serve mode (`actors.settings.AppConfig`, which
extends `Settings` with its deployment sections) and bare mode (`StandaloneSettings`, which
adds the listening address). Every field can be overridden from the environment with the
`FIRSTLIGHT_` prefix, nested sections joined by `__`; the environment wins over the YAML:

    FIRSTLIGHT_ENGINE__SCHEDULER__MAX_NUM_SEQS=8 FIRSTLIGHT_KEEPALIVE_S=5 python -m app.standalone

Unknown keys are errors naming the field (a typo must not silently fall back to a default).
`engine` is validated straight into `engine.config.EngineConfig` (app/config_schema.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.config_schema import validated
from engine.config import EngineConfig


class AuthSettings(BaseModel):
    """API keys for `/v1` routes (app/auth.py); none configured: no keys required."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_keys: list[str] = Field(default_factory=list)
    api_keys_file: str = ""  # one key per line


class BatchSettings(BaseModel):
    """Batch jobs (`/v1/files`, `/v1/batches`; app/batch/). `directory` holds the SQLite
    store and the files (empty: `$FIRSTLIGHT_HOME/batches`; on a cluster, a path every node
    shares). Uploads past `max_file_bytes` or `max_lines` are refused; `completion_window`
    may be at most `max_completion_window_s`. How many lines run at once is the cluster bulk
    throttle's (`policies.bulk_throttle`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    directory: str = ""
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)
    max_lines: int = Field(50_000, ge=1)
    max_completion_window_s: int = Field(7 * 24 * 3600, ge=60)

    def path(self) -> Path:
        if self.directory:
            return Path(self.directory).expanduser()
        home = os.environ.get("FIRSTLIGHT_HOME")
        return (Path(home).expanduser() if home else Path.home() / ".cache" / "firstlight") / (
            "batches"
        )


class PolicySettings(BaseModel):
    """Policy names, each looked up in its `policies/` registry when the app is built, and
    each policy's options keyed by its name (`routing_options[name]` go to routing policy
    `name`'s constructor when it is the one chosen, so switching a policy, e.g. by
    environment, needs no other change). Serve mode only: `routing` picks the ModelReplica
    router, `bulk_throttle` how much bulk every caller lets into the engines, `autoscaling`
    the replica autoscaler. The step order inside a replica is the engine's
    (`engine.scheduler.policy`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_class: str = "header"
    routing: str = "class_pools"
    routing_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    bulk_throttle: str = "spare_capacity"
    bulk_throttle_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    autoscaling: str = "slo"
    autoscaling_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def options(self, family: Literal["routing", "bulk_throttle", "autoscaling"]) -> dict[str, Any]:
        """A copy of the options of the policy chosen for `family`."""
        chosen, options = {
            "routing": (self.routing, self.routing_options),
            "bulk_throttle": (self.bulk_throttle, self.bulk_throttle_options),
            "autoscaling": (self.autoscaling, self.autoscaling_options),
        }[family]
        return dict(options.get(chosen, {}))


class Settings(BaseSettings):
    """Build one with `Settings(**args)`; bad values raise `pydantic.ValidationError` naming
    the field."""

    model_config = SettingsConfigDict(
        env_prefix="FIRSTLIGHT_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    served_model_name: str = ""  # what clients send as `model`; empty: `engine.model`
    keepalive_s: float = Field(15.0, gt=0)  # idle gap before an SSE `:` keepalive comment
    stall_timeout_s: float = Field(60.0, gt=0)  # an HTTP client reading nothing this long is cut
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger bodies get 413 unread
    max_n: int = Field(16, ge=1)  # most choices (`n`) one request may ask for
    max_label_values: int = Field(32, ge=1)  # distinct tag values per metric label
    engine: validated(EngineConfig) = EngineConfig()  # type: ignore[valid-type]
    policies: PolicySettings = PolicySettings()
    batch: BatchSettings = BatchSettings()
    auth: AuthSettings = AuthSettings()

    @model_validator(mode="before")
    @classmethod
    def _name_defaults_to_the_model(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and not data.get("served_model_name"):
            engine = data.get("engine") or {}
            model = engine.model if isinstance(engine, EngineConfig) else engine.get("model")
            data = {**data, "served_model_name": model or EngineConfig().model}
        return data

    @property
    def request_class_policy(self) -> str:
        return self.policies.request_class

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)  # the environment overrides the YAML args


class StandaloneSettings(Settings):
    """Bare mode (`python -m app.standalone`): the shared settings plus where to listen.
    Build it with `layered` so command-line flags win over the environment."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: str = "info"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)  # `layered` has already put flags over env

    @classmethod
    def layered(cls, *layers: Mapping[str, Any]) -> StandaloneSettings:
        """`layers` from lowest to highest precedence, with the environment placed just
        below the last one: `layered(yaml_args, flags)` is flags > env > YAML > defaults."""
        *below, top = layers or ({},)
        env = EnvSettingsSource(cls)()
        merged: dict[str, Any] = {}
        for layer in (*below, env, top):
            merged = deep_merge(merged, layer)
        return cls(**merged)


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Serve's direct ingress, as a Serve config turns it on (`controller_options.runtime_env.
# env_vars`; actors/serve_internals.py says what Serve does with each): every Ingress replica
# serves HTTP itself, on the first free port of [MIN, MAX) on its node, and Serve's own proxy
# keeps `http_options.port` as a fallback one hop longer. Clients use the former.
SERVE_DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
SERVE_DIRECT_PORT_MIN = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
SERVE_DIRECT_PORT_MAX = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
SERVE_DEFAULT_PORT = 8000


def serve_http_address(config: Mapping[str, Any]) -> dict[str, Any]:
    """Where clients reach the application of a Serve config (a parsed `serve_config.yaml`):
    `host` from `http_options`, and `port` the Ingress's own when direct ingress is on, else
    `http_options.port` (Serve's proxy). Keys the config leaves unset are absent."""
    http = config.get("http_options") or {}
    address = {k: http[k] for k in ("host", "port") if k in http}
    env = ((config.get("controller_options") or {}).get("runtime_env") or {}).get("env_vars") or {}
    if str(env.get(SERVE_DIRECT_INGRESS, "0")) == "1":
        address["port"] = int(env.get(SERVE_DIRECT_PORT_MIN, 30000))  # Serve's own default
    return address
