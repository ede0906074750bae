"""scripts/two_node.sh without a cluster: the README's recipe is the script's, the deployed
config places what it says, and `stop` picks exactly this cluster's processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from actors.builder import application, load_config
from actors.serve_internals import bound_deployment
from app.settings import serve_http_address
from tests.scripts.helpers import ROOT, SCRIPT, two_node


def readme_commands() -> list[str]:
    """The commands of the README's two-node section: code-block lines (continuations
    joined) that run something from the venv or export its environment."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## A two-node cluster on one machine\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        joined = re.sub(r" \\\n\s+", " ", block)
        commands += [
            line for line in joined.splitlines() if line.startswith((".venv/bin/", "export "))
        ]
    return commands


def test_the_readme_recipe_is_exactly_what_the_script_runs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FL_") and k != "VENV"}
    printed = subprocess.run(
        [str(SCRIPT), "print"], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(printed) == 8
    assert readme_commands() == printed


def test_the_deployed_config_pins_replicas_to_node2_and_the_rest_to_the_head(tmp_path):
    dst = tmp_path / "serve_config.yaml"
    two_node().write_config(ROOT / "serve_config.yaml", dst, http_port=18123)
    deployed = yaml.safe_load(dst.read_text())
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert serve_http_address(deployed) == {"host": "127.0.0.1", "port": 18123}
    assert deployed["http_options"] == {"host": "127.0.0.1", "port": 18223}  # the proxy
    env = deployed["controller_options"]["runtime_env"]["env_vars"]
    assert env == {
        **shipped["controller_options"]["runtime_env"]["env_vars"],
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "18123",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "18124",
    }
    (app,) = deployed["applications"]
    config = load_config(app["args"])  # what `serve deploy` hands build_app: valid
    assert config.replica.resources == {"node2": 0.01}
    assert config.ingress.channel_tcp_host == "127.0.0.1"
    assert config.draft_replica.host == "loopback"
    # nothing else changed: the engine, policies, autoscaling are serve_config.yaml's own
    (shipped_app,) = shipped["applications"]
    assert load_config(shipped_app["args"]).engine == config.engine
    assert app["args"]["replica"]["autoscaling"] == shipped_app["args"]["replica"]["autoscaling"]

    ingress = bound_deployment(application(config))
    _, replicas, control_plane, batch_jobs = (bound_deployment(a) for a in ingress.init_args)
    draft = bound_deployment(replicas.init_args[2])
    assert replicas.ray_actor_options["resources"] == {"node2": 0.01}
    for deployment in (ingress, control_plane, batch_jobs, draft):
        assert deployment.ray_actor_options["resources"] == {"head": 0.01}, deployment.name


def test_the_token_is_the_clusters_own_and_kept(tmp_path):
    path = tmp_path / "auth_token"
    module = two_node()
    module.write_token(path)
    token = path.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert path.stat().st_mode & 0o777 == 0o600
    module.write_token(path)  # a second `up` keeps the running cluster's token
    assert path.read_text() == token


def test_stop_picks_this_clusters_processes_and_spares_the_rest(tmp_path):
    cluster = tmp_path / "cluster"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = [
        [*sleep, f"--temp-dir={cluster}/head"],  # a Ray daemon naming the cluster's dir
        [*sleep, "ray.util.client.server", "--address=192.0.2.2:23400"],  # its client server
    ]
    others = [
        [*sleep, f"--temp-dir={tmp_path}/cluster-2/head"],  # another cluster beside it
        [*sleep, "ray.util.client.server", "--address=192.0.2.2:23401"],  # another GCS port
    ]
    procs = [subprocess.Popen(args) for args in ours + others]
    try:
        time.sleep(0.2)
        found = {p.pid for p in two_node().cluster_processes(Path(cluster), 23400)}
        assert found == {p.pid for p in procs[:2]}
        assert two_node().stop(Path(cluster), 23400, grace_s=5) == 0
        assert [p.poll() is not None for p in procs] == [True, True, False, False]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
