"""serve_config.yaml args → AppConfig → a Serve application: validation and env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from actors.builder import (
    ConfigError,
    application,
    autoscaling_config,
    build_app,
    load_config,
    request_router,
)
from actors.serve_internals import bound_deployment, deployment_config
from actors.settings import AppConfig
from app.settings import Settings
from app.standalone import SERVE_ONLY_SECTIONS, parse_settings
from engine.config import CacheConfig, EngineConfig, SchedulerConfig

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
        + (config.draft_replica.num_cpus if config.uses_draft_replica else 0.0)
        + (config.batch_jobs.num_cpus if config.batch.enabled else 0.0)
    )
    assert cpus <= 2.0 + 1e-9
    assert config.uses_draft_replica  # the demo speculates with its DraftReplica
    # The engine's own bounded queue fills before Serve's replica limit does.
    scheduler = config.engine.scheduler
    assert config.replica_max_ongoing_requests == scheduler.max_num_seqs + 2 * scheduler.max_waiting


def test_environment_overrides_yaml_args(monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_ENGINE__SCHEDULER__MAX_NUM_SEQS", "3")
    monkeypatch.setenv("FIRSTLIGHT_KEEPALIVE_S", "2.5")
    monkeypatch.setenv("FIRSTLIGHT_HOME", "/somewhere")  # other FIRSTLIGHT_ variables: ignored
    config = load_config(
        {"keepalive_s": 9, "engine": {"scheduler": {"max_num_seqs": 40, "max_waiting": 7}}}
    )
    assert config.engine.scheduler.max_num_seqs == 3
    assert config.engine.scheduler.max_waiting == 7  # the rest of the section keeps the YAML
    assert config.keepalive_s == 2.5


def test_the_engine_section_is_the_engines_own_config():
    engine = AppConfig(
        engine={
            "stall_timeout_s": 5,
            "cache": {"kv_cache_bytes": 8 << 20},
            "scheduler": {"max_num_seqs": 5, "max_waiting": 6, "max_num_batched_tokens": 256},
        }
    ).engine
    assert engine == EngineConfig(
        stall_timeout_s=5.0,
        cache=CacheConfig(kv_cache_bytes=8 << 20),
        scheduler=SchedulerConfig(max_num_seqs=5, max_waiting=6, max_num_batched_tokens=256),
    )


def test_defaults_are_the_engines_own():
    assert AppConfig().engine == EngineConfig()


def test_bare_and_serve_mode_run_the_same_engine_from_one_yaml(monkeypatch, tmp_path):
    monkeypatch.setenv("FIRSTLIGHT_ENGINE__CACHE__NUM_BLOCKS", "77")  # applies to both modes
    path = tmp_path / "serve_config.yaml"
    path.write_text((ROOT / "serve_config.yaml").read_text())
    serve_mode = load_config(shipped_args())
    bare_mode = parse_settings(["--config", str(path)])
    assert bare_mode.engine == serve_mode.engine
    assert serve_mode.engine.cache.num_blocks == 77
    assert serve_mode.engine != EngineConfig(cache=CacheConfig(num_blocks=77))  # YAML applied
    shared = set(Settings.model_fields)
    assert bare_mode.model_dump(include=shared) == serve_mode.model_dump(include=shared)


def test_bare_mode_skips_exactly_the_serve_only_sections():
    assert set(AppConfig.model_fields) - set(Settings.model_fields) == set(SERVE_ONLY_SECTIONS)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"engin": {}}, ["engin", "Extra inputs"]),
        (
            {"engine": {"scheduler": {"max_num_seqs": 0}}},
            ["engine.scheduler.max_num_seqs", "greater than or equal"],
        ),
        ({"engine": {"max_num_seqs": 8}}, ["engine.max_num_seqs", "Extra inputs"]),  # old shape
        ({"engine": {"cache": {"kv_cache_byte": 1 << 30}}}, ["engine.cache.kv_cache_byte"]),
        ({"engine": {"dtype": "int8"}}, ["engine.dtype", "float16"]),
        ({"engine": {"stall_timeout_s": 0}}, ["engine.stall_timeout_s", "greater than"]),
        ({"replica": {"autoscaling": {"min_replicas": 3}}}, ["min_replicas <= initial_replicas"]),
        ({"policies": {"request_class": "nope"}}, ["policies", "nope", "header"]),
        ({"ingress": {"transport": "carrier-pigeon"}}, ["ingress.transport"]),
        ({"ingress": {"token_path": "smoke"}}, ["ingress.token_path"]),
        ({"policies": {"routing": "nope"}}, ["policies", "nope", "prefix_affinity"]),
        (
            {"engine": {"scheduler": {"policy": "nope"}}},
            ["engine.scheduler.policy", "nope", "deadline, fcfs, priority"],
        ),
        ({"replica": {"resources": {"CPU": 1}}}, ["replica.resources", "not a custom one"]),
        ({"ingress": {"resources": {"head": 1.5}}}, ["ingress.resources", "whole number"]),
        ({"control_plane": {"resources": {"head": 0}}}, ["control_plane.resources"]),
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


SKETCHES = {"control_plane": "ControlPlane", "model": "demo", "sketch_sync_s": 0.5}


def test_routing_options_apply_to_their_own_policy_only():
    args: dict = {
        "policies": {
            "routing": "prefix_affinity",
            "routing_options": {"prefix_affinity": {"max_imbalance": 3}},
        }
    }
    kwargs = request_router(load_config(args)).request_router_kwargs
    assert kwargs == {
        "policy": "prefix_affinity",
        **SKETCHES,
        "max_imbalance": 3,
        "block_size": 16,
    }
    args["policies"]["routing"] = "least_loaded"  # e.g. FIRSTLIGHT_POLICIES__ROUTING
    kwargs = request_router(load_config(args)).request_router_kwargs
    assert kwargs == {"policy": "least_loaded", **SKETCHES}


def test_every_policy_is_chosen_by_name_with_its_options():
    config = load_config(
        {
            "policies": {
                "autoscaling": "queue_depth",
                "autoscaling_options": {"slo": {"ttft_slo_s": 0.2}},
                "bulk_throttle": "unlimited",
            },
            "replica": {"autoscaling": {"target_ongoing_requests": 4}},
        }
    )
    policy = autoscaling_config(config)["policy"]
    assert policy == {
        "policy_function": "actors.autoscaler:ReplicaAutoscaler",
        "policy_kwargs": {"policy": "queue_depth", "target_ongoing_requests": 4.0},
    }
    for bad, words in [
        ({"autoscaling": "psychic"}, ["psychic", "queue_depth", "slo"]),
        ({"bulk_throttle_options": {"spare_capacity": {"busy_share": 3}}}, ["busy_share"]),
        ({"routing_options": {"class_pools": {"other_pool": "x"}}}, ["other_pool"]),
        ({"autoscaling_options": {"slo": {"kv_hi": 0.5}}}, ["kv_hi"]),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config({"policies": bad})
        for word in words:
            assert word in str(info.value)


def test_serverless_scales_to_zero_and_dedicated_keeps_a_replica_warm():
    serverless = load_config({"replica": {"autoscaling": {"mode": "serverless"}}})
    assert autoscaling_config(serverless)["min_replicas"] == 0
    assert autoscaling_config(load_config({}))["min_replicas"] == 1
    for bad in (
        {"mode": "dedicated", "min_replicas": 0},
        {"mode": "serverless", "min_replicas": 1},
    ):
        with pytest.raises(ConfigError, match="min_replicas"):
            load_config({"replica": {"autoscaling": bad}})


def test_a_missing_model_fails_at_build_time(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.model"):
        build_app({"engine": {"model": str(tmp_path / "nowhere")}})


def test_the_application_wires_three_deployments():
    app = application(load_config({"replica": {"autoscaling": {"max_replicas": 1}}}))
    ingress = bound_deployment(app)
    assert ingress.name == "Ingress"
    _, replicas, control_plane, batch_jobs = (bound_deployment(a) for a in ingress.init_args)
    assert (replicas.name, control_plane.name) == ("ModelReplica", "ControlPlane")
    assert batch_jobs.name == "BatchJobs"
    autoscaling = deployment_config(replicas).autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 1)
    router = deployment_config(replicas).request_router_config
    assert router.request_router_class == "actors.request_router.PolicyRequestRouter"
    assert router.request_router_kwargs == {
        "policy": "class_pools",
        **SKETCHES,
        "block_size": 16,
        "throttle": "spare_capacity",  # lends bulk what the callers' throttle allows
        "throttle_options": {},
    }
    assert autoscaling.policy.policy_function == "actors.autoscaler:ReplicaAutoscaler"


@pytest.mark.parametrize(
    ("args", "draft"),
    [
        ({}, False),  # the engine's default: no speculation
        ({"engine": {"speculative": {"method": "draft_model"}}}, True),
        (
            {
                "engine": {"speculative": {"method": "draft_model"}},
                "draft_replica": {"enabled": False},  # the draft runs inside each replica
            },
            False,
        ),
        ({"engine": {"speculative": {"method": "prompt_lookup"}}}, False),
    ],
)
def test_a_draft_replica_is_wired_only_when_drafts_come_from_one(args, draft):
    app = application(load_config(args))
    _, replicas, _, _ = (bound_deployment(a) for a in bound_deployment(app).init_args)
    draft_arg = replicas.init_args[2]
    if draft:
        deployment = bound_deployment(draft_arg)
        assert deployment.name == "DraftReplica"
        assert deployment_config(deployment).num_replicas == 1
    else:
        assert draft_arg is None


def test_each_section_places_its_deployment_by_custom_resources():
    pinned = {"resources": {"node2": 0.01}}
    head = {"resources": {"head": 0.01}}
    config = load_config(
        {
            "engine": {"speculative": {"method": "draft_model"}},
            "replica": pinned,
            "ingress": head,
            "control_plane": head,
            "draft_replica": head,
            "batch_jobs": {"resources": {"head": 1}},
        }
    )
    ingress = bound_deployment(application(config))
    _, replicas, control_plane, batch_jobs = (bound_deployment(a) for a in ingress.init_args)
    draft = bound_deployment(replicas.init_args[2])
    assert replicas.ray_actor_options == {"num_cpus": 0.6, "resources": {"node2": 0.01}}
    for deployment in (ingress, control_plane, draft):
        assert deployment.ray_actor_options["resources"] == {"head": 0.01}
    assert batch_jobs.ray_actor_options == {"num_cpus": 0.1, "resources": {"head": 1.0}}
    # unset: Ray's own placement, no resources asked for
    default = bound_deployment(application(load_config({})))
    assert default.ray_actor_options == {"num_cpus": 0.4}


def test_the_gpu_config_serves_one_replica_per_gpu_from_free_memory():
    config = yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())
    (app,) = config["applications"]
    gpu = load_config(app["args"])
    assert (gpu.engine.device, gpu.engine.dtype) == ("auto", "auto")
    assert gpu.engine.cache.kv_cache_bytes is None and gpu.engine.cache.num_blocks is None
    assert gpu.engine.speculative.method == "off" and not gpu.uses_draft_replica
    assert gpu.replica_num_gpus(cluster_gpus=0) == 1.0  # asked for even where none is seen
    assert gpu.replica.autoscaling.max_replicas == 1
    replicas = bound_deployment(bound_deployment(application(gpu)).init_args[1])
    assert replicas.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert (
        config["controller_options"]
        == yaml.safe_load((ROOT / "serve_config.yaml").read_text())["controller_options"]
    )  # the same Serve tuning as the CPU config


@pytest.mark.parametrize(
    ("engine", "num_gpus", "cluster_gpus", "expected"),
    [
        ({"device": "auto"}, None, 0.0, 0.0),  # auto on a CPU cluster
        ({"device": "auto"}, None, 8.0, 1.0),  # auto where the cluster has GPUs
        ({}, None, 8.0, 0.0),  # the default: the CPU, whatever the cluster has
        ({"device": "cuda"}, None, 0.0, 1.0),
        ({"device": "cuda:0"}, 0.5, 8.0, 0.5),  # explicit: two replicas share a GPU
    ],
)
def test_a_replica_asks_serve_for_a_gpu_when_its_engine_runs_on_cuda(
    engine, num_gpus, cluster_gpus, expected
):
    config = load_config({"engine": engine, "replica": {"num_gpus": num_gpus}})
    assert config.replica_num_gpus(cluster_gpus) == expected
