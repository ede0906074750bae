"""Loads `scripts/two_node.py` (the scripts folder is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "two_node.sh"


def two_node() -> ModuleType:
    spec = importlib.util.spec_from_file_location("two_node", ROOT / "scripts" / "two_node.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
