"""Choosing an attention backend by name, or the best one that supports the setup.

A backend registers itself with `@register_backend(priority=...)` on its class; the
decorator returns the class unchanged. `select_backend` first imports every module of this
package (a backend module whose optional dependency is missing, such as Triton or
flash-attn, raises ImportError and is skipped), so a new backend needs no edit here. Each
choice is logged with the reasons the better-ranked backends were passed over (a backend's
`why_not`), so "why is this replica on the slow path?" has an answer in the log.

Higher priority wins when no name is given: the torch reference backend (priority 0) runs
anywhere and is the fallback; GPU kernels register above it.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass
from typing import TypeVar

import torch

import kernels
from kernels.interface import AttentionBackend

B = TypeVar("B", bound=type[AttentionBackend])

log = logging.getLogger("firstlight.kernels")

_SKIP_MODULES = frozenset({"interface", "registry", "kv_write", "graph_metadata", "layer_ops"})


@dataclass(frozen=True, slots=True)
class _Entry:
    cls: type[AttentionBackend]
    priority: int


# The one registry of the process: filled by class decorators at import time, never mutated
# afterwards except by registering a new class (re-registering a name replaces it).
_BACKENDS: dict[str, _Entry] = {}


def register_backend(priority: int = 0):
    """Class decorator: make `cls` selectable by `cls.name`; returns `cls` unchanged."""

    def wrap(cls: B) -> B:
        if not cls.name or cls.name == AttentionBackend.name:
            raise ValueError(f"{cls.__qualname__} must set a unique `name`")
        _BACKENDS[cls.name] = _Entry(cls, priority)
        return cls

    return wrap


def _import_backend_modules() -> dict[str, str]:
    """Import every backend module; returns module name -> ImportError message of those that
    failed (an optional dependency such as triton or flash-attn is not installed)."""
    failed = {}
    for mod in pkgutil.iter_modules(kernels.__path__):
        if mod.name in _SKIP_MODULES or mod.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"kernels.{mod.name}")
        except ImportError as exc:
            failed[f"kernels.{mod.name}"] = str(exc)
    return failed


def available_backends() -> dict[str, int]:
    """Registered backend names and their priorities (whether or not they support this host)."""
    _import_backend_modules()
    return {name: e.priority for name, e in _BACKENDS.items()}


def select_backend(
    name: str | None,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
) -> AttentionBackend:
    """An instance of backend `name`, or of the highest-priority backend that supports the setup.

    Logs (INFO, logger `kernels.registry`) the backend chosen and, when choosing by priority,
    why each backend module failed to import and why each higher-priority backend was
    skipped. Raises ValueError when `name` is unknown, when it does not support the setup, or
    when no backend does; the message carries the reasons.
    """
    failed = _import_backend_modules()
    device = torch.device(device)
    where = f"device={device}, dtype={dtype}, head_dim={head_dim}, block_size={block_size}"

    def why_not(cls: type[AttentionBackend]) -> str | None:
        return cls.why_not(device=device, dtype=dtype, head_dim=head_dim, block_size=block_size)

    if name is not None:
        entry = _BACKENDS.get(name)
        if entry is None:
            known = ", ".join(sorted(_BACKENDS)) or "none"
            raise ValueError(f"unknown attention backend {name!r} (known: {known})")
        reason = why_not(entry.cls)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} does not support {where}: {reason}")
        log.info("attention backend %s chosen by name for %s", name, where)
        return entry.cls()
    for module, message in sorted(failed.items()):
        log.info("attention backend module %s skipped: import failed: %s", module, message)
    ranked = sorted(_BACKENDS.values(), key=lambda e: e.priority, reverse=True)
    skipped = []
    for entry in ranked:
        reason = why_not(entry.cls)
        if reason is None:
            log.info("attention backend %s chosen for %s", entry.cls.name, where)
            return entry.cls()
        log.info(
            "attention backend %s (priority %d) skipped: %s", entry.cls.name, entry.priority, reason
        )
        skipped.append(f"{entry.cls.name}: {reason}")
    raise ValueError(f"no attention backend supports {where} ({'; '.join(skipped) or 'none'})")
