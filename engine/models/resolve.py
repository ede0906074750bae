"""How the engine turns `EngineConfig.model` into a local directory: a hook, never a hub.

The engine knows only local Hugging Face directories (`local_model_dir`). Whoever builds an
engine may pass another `ModelResolver` that knows more names (the embedded demo models:
`demo.paths.resolve_model`), so the engine never imports what builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ModelResolver = Callable[[str], Path]


class ModelNotFoundError(FileNotFoundError):
    """The named model has no usable local directory. The message says how to get one."""


def local_model_dir(name_or_path: str) -> Path:
    """`name_or_path` as a local model directory; `ModelNotFoundError` when it is not one."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"model {name_or_path!r} is not a local directory")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {path} has no config.json")
    return path
