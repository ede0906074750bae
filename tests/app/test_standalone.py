"""`python -m app.standalone` settings: environment first, flags on top."""

from __future__ import annotations

import pytest

from app.standalone import parse_settings


def test_defaults(monkeypatch):
    for key in ("FIRSTLIGHT_PORT", "FIRSTLIGHT_MODEL", "FIRSTLIGHT_HOST"):
        monkeypatch.delenv(key, raising=False)
    settings = parse_settings([])
    assert (settings.model, settings.host, settings.port) == ("demo", "127.0.0.1", 8000)
    assert settings.max_body_bytes == 4 * 1024 * 1024 and settings.keepalive_s == 15.0


def test_environment_then_flags(monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_PORT", "9001")
    monkeypatch.setenv("FIRSTLIGHT_KEEPALIVE_S", "2.5")
    monkeypatch.setenv("FIRSTLIGHT_MODEL", "/models/a")
    settings = parse_settings(["--model", "demo", "--host", "0.0.0.0"])
    assert (settings.model, settings.host, settings.port) == ("demo", "0.0.0.0", 9001)
    assert settings.keepalive_s == 2.5


def test_invalid_values_are_refused(monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_KEEPALIVE_S", "0")
    with pytest.raises(ValueError):
        parse_settings([])
