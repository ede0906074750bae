"""Fixtures shared by the model and runner tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.hf_tiny import FAMILIES, make_hf_model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """family -> (transformers model, directory it was saved to)."""
    out = {}
    for family in FAMILIES:
        model = make_hf_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = (model, path)
    return out
