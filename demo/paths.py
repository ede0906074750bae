"""Where models live. Never touches the network.

`firstlight_home()` is `$FIRSTLIGHT_HOME`, else `~/.cache/firstlight`. The built-in demo
models live in `<home>/models/demo` and `<home>/models/demo-draft` (see `demo.build`);
any other model name is a local Hugging Face directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.models.resolve import ModelNotFoundError, local_model_dir

__all__ = ["DEMO_MODELS", "ModelNotFoundError", "demo_dir", "firstlight_home", "resolve_model"]

DEMO_MODELS: tuple[str, ...] = ("demo", "demo-draft")
MANIFEST = "firstlight_demo.json"


def firstlight_home() -> Path:
    env = os.environ.get("FIRSTLIGHT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "firstlight"


def demo_dir(name: str, home: Path | None = None) -> Path:
    """The directory of built-in model `name` ("demo" or "demo-draft"), built or not."""
    if name not in DEMO_MODELS:
        raise ValueError(f"not a demo model: {name!r}")
    return (home or firstlight_home()) / "models" / name


def resolve_model(name_or_path: str) -> Path:
    """The local directory for a model name.

    "demo" and "demo-draft" map to the built demo models; anything else is taken as a path
    to a Hugging Face model directory. Raises `ModelNotFoundError` when the directory is
    missing or has no config.json (for the demo models: when they are not built yet).
    """
    if name_or_path in DEMO_MODELS:
        path = demo_dir(name_or_path)
        if not (path / "config.json").is_file() or not (path / MANIFEST).is_file():
            raise ModelNotFoundError(
                f"the {name_or_path!r} model is not built yet (looked in {path}); "
                "run `make demo` or `python -m demo.build` (about 3 minutes on CPU)"
            )
        return path
    if not Path(name_or_path).expanduser().is_dir():
        raise ModelNotFoundError(
            f"model {name_or_path!r} is neither a built-in model {DEMO_MODELS} "
            "nor a local directory"
        )
    return local_model_dir(name_or_path)
