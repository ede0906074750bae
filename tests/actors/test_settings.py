"""serve_config.yaml args → AppConfig → a Serve application: validation and env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from actors.builder import ConfigError, application, build_app, load_config, request_router
from actors.settings import AppConfig

ROOT = Path(__file__).resolve().parents[2]


def shipped_args() -> dict:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "actors.builder:build_app"
    return app["args"]


def test_shipped_serve_config_is_valid_and_fits_two_cores():
    config = load_config(shipped_args())
    assert config.served_model_name == "demo"
    assert config.replica.autoscaling.min_replicas >= 1
    cpus = (
        config.ingress.num_cpus * config.ingress.num_replicas
        + config.control_plane.num_cpus
        + config.replica.num_cpus * config.replica.autoscaling.max_replicas
    )
    assert cpus <= 2.0
    # The engine's own bounded queue fills before Serve's replica limit does.
    assert config.replica_max_ongoing_requests == (
        config.engine.max_num_seqs + config.engine.max_waiting
    )


def test_environment_overrides_yaml_args(monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_ENGINE__MAX_NUM_SEQS", "3")
    monkeypatch.setenv("FIRSTLIGHT_KEEPALIVE_S", "2.5")
    monkeypatch.setenv("FIRSTLIGHT_HOME", "/somewhere")  # other FIRSTLIGHT_ variables: ignored
    config = load_config({"keepalive_s": 9, "engine": {"max_num_seqs": 40, "max_waiting": 7}})
    assert config.engine.max_num_seqs == 3
    assert config.engine.max_waiting == 7  # the rest of the section keeps the YAML value
    assert config.keepalive_s == 2.5


def test_engine_config_carries_the_limits():
    engine = AppConfig(
        engine={
            "kv_cache_bytes": 8 << 20,
            "max_num_seqs": 5,
            "max_waiting": 6,
            "max_num_batched_tokens": 256,
        }
    ).engine.engine_config()
    assert (
        engine.cache.kv_cache_bytes,
        engine.scheduler.max_num_seqs,
        engine.scheduler.max_waiting,
        engine.scheduler.max_num_batched_tokens,
    ) == (8 << 20, 5, 6, 256)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"engin": {}}, ["engin", "Extra inputs"]),
        ({"engine": {"max_num_seqs": 0}}, ["engine.max_num_seqs", "greater than or equal"]),
        ({"replica": {"autoscaling": {"min_replicas": 3}}}, ["min_replicas <= initial_replicas"]),
        ({"policies": {"request_class": "nope"}}, ["policies", "nope", "header"]),
        ({"ingress": {"transport": "carrier-pigeon"}}, ["ingress.transport"]),
        ({"ingress": {"token_path": "smoke"}}, ["ingress.token_path"]),
        ({"policies": {"routing": "nope"}}, ["policies", "nope", "prefix_affinity"]),
        (
            {"policies": {"routing_options": {"prefix_affinity": {"max_imbalanse": 1}}}},
            ["policies", "max_imbalanse"],
        ),
    ],
)
def test_bad_config_fails_with_a_message_naming_the_field(args, words):
    with pytest.raises(ConfigError) as info:
        build_app(args)
    for word in words:
        assert word in str(info.value)


def test_routing_options_apply_to_their_own_policy_only():
    args = {"policies": {"routing_options": {"prefix_affinity": {"max_imbalance": 3}}}}
    kwargs = request_router(load_config(args)).request_router_kwargs
    assert kwargs == {"policy": "prefix_affinity", "max_imbalance": 3, "block_size": 16}
    args["policies"]["routing"] = "least_loaded"  # e.g. FIRSTLIGHT_POLICIES__ROUTING
    assert request_router(load_config(args)).request_router_kwargs == {"policy": "least_loaded"}


def test_a_missing_model_fails_at_build_time(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.model"):
        build_app({"engine": {"model": str(tmp_path / "nowhere")}})


def test_the_application_wires_three_deployments():
    app = application(load_config({"replica": {"autoscaling": {"max_replicas": 1}}}))
    ingress = app._bound_deployment  # Serve has no public accessor for a bound graph
    assert ingress.name == "Ingress"
    _, replicas, control_plane = (getattr(a, "_bound_deployment", a) for a in ingress.init_args)
    assert (replicas.name, control_plane.name) == ("ModelReplica", "ControlPlane")
    autoscaling = replicas._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 1)
    router = replicas._deployment_config.request_router_config
    assert router.request_router_class == "actors.request_router.PolicyRequestRouter"
    assert router.request_router_kwargs == {"policy": "prefix_affinity", "block_size": 16}
