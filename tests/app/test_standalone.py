"""`python -m app.standalone` settings: serve_config.yaml's args, then environment, then flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.standalone import parse_settings
from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in ("FIRSTLIGHT_PORT", "FIRSTLIGHT_HOST", "FIRSTLIGHT_ENGINE__MODEL"):
        monkeypatch.delenv(key, raising=False)


def write_config(tmp_path: Path, **args_over) -> Path:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(args_over)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_defaults_without_a_config_file(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no ./serve_config.yaml here
    settings = parse_settings([])
    assert (settings.engine.model, settings.host, settings.port) == ("demo", "127.0.0.1", 8000)
    assert settings.max_body_bytes == 4 * 1024 * 1024 and settings.keepalive_s == 15.0
    assert settings.engine == EngineConfig()
    assert settings.served_model_name == "demo"  # defaults to the engine's model


def test_the_serve_config_in_the_working_directory_is_read(monkeypatch):
    monkeypatch.chdir(ROOT)
    settings = parse_settings([])
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    scheduler = shipped["applications"][0]["args"]["engine"]["scheduler"]
    assert settings.engine.scheduler.max_num_seqs == scheduler["max_num_seqs"]
    assert settings.engine != EngineConfig()


def test_config_then_environment_then_flags(monkeypatch, tmp_path):
    path = write_config(tmp_path, keepalive_s=7, engine={"model": "/models/yaml", "seed": 4})
    monkeypatch.setenv("FIRSTLIGHT_PORT", "9001")
    monkeypatch.setenv("FIRSTLIGHT_ENGINE__MODEL", "/models/env")
    monkeypatch.setenv("FIRSTLIGHT_KEEPALIVE_S", "2.5")
    settings = parse_settings(["--config", str(path), "--host", "0.0.0.0"])
    assert (settings.engine.model, settings.host, settings.port) == ("/models/env", "0.0.0.0", 9001)
    assert settings.keepalive_s == 2.5 and settings.engine.seed == 4
    settings = parse_settings(["--config", str(path), "--model", "demo", "--keepalive-s", "1"])
    assert (settings.engine.model, settings.keepalive_s) == ("demo", 1.0)  # flags win
    assert settings.engine.seed == 4  # the rest of the engine section keeps the YAML value


def test_serve_only_sections_are_skipped_but_typos_are_not(tmp_path):
    path = write_config(tmp_path, replica={"num_cpus": 3})
    assert parse_settings(["--config", str(path)]).engine.model == "demo"
    path = write_config(tmp_path, keepalive=3)
    with pytest.raises(ValueError, match="keepalive"):
        parse_settings(["--config", str(path)])


def test_invalid_values_are_refused(monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_KEEPALIVE_S", "0")
    with pytest.raises(ValueError):
        parse_settings([])
    monkeypatch.delenv("FIRSTLIGHT_KEEPALIVE_S")
    with pytest.raises(ValueError, match=r"engine\.dtype"):
        parse_settings(["--dtype", "int8"])


def test_the_client_port_is_the_ingress_own_when_direct_ingress_is_on():
    from app.settings import serve_http_address

    proxy_only = {"http_options": {"host": "127.0.0.1", "port": 8100}}
    assert serve_http_address(proxy_only) == {"host": "127.0.0.1", "port": 8100}
    env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    direct = {**proxy_only, "controller_options": {"runtime_env": {"env_vars": env}}}
    assert serve_http_address(direct)["port"] == 30000  # Serve's own first port
    env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = "8000"
    assert serve_http_address(direct) == {"host": "127.0.0.1", "port": 8000}
    env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0"
    assert serve_http_address(direct)["port"] == 8100
    assert serve_http_address({}) == {}
