#!/usr/bin/env bash
# A two-node Ray cluster on one machine, with serve_config.yaml deployed on it.
#
#   scripts/two_node.sh up      start a head node and a second node, deploy, wait until it answers
#   scripts/two_node.sh down    stop this cluster's Ray processes, and only those
#   scripts/two_node.sh print   print the commands `up` and `down` run (README), running nothing
#
# The head node (resource `head`) runs the Serve controller, the HTTP proxy, the Ingress, the
# ControlPlane, the DraftReplica and BatchJobs; the second node (resource `node2`) runs the
# model replicas. To Ray a second raylet on the same host is a real second node, so tokens
# travel from the replicas to the ingress over the token channel's TCP path.
#
# Everything firstlight listens on is 127.0.0.1 (HTTP, dashboard, token channel, draft
# channel). Ray's own daemons choose for themselves: the GCS and the raylets listen on all
# interfaces and Ray takes the host's address as the nodes' address (it replaces a
# --node-ip-address of 127.0.0.1 with it), so the cluster runs with Ray's token
# authentication, with a token of its own (FL_CLUSTER_DIR/auth_token).
#
# Environment (defaults in brackets):
#   FL_CLUSTER_DIR [/tmp/fl-two-node]  both nodes' Ray temp dirs and the deployed config
#   FL_PORT        [6390]              the head's GCS port; the cluster's other fixed ports
#                                      are FL_PORT+1 .. FL_PORT+299 (listed below)
#   FL_HTTP_PORT   [8000]              the application's HTTP port
#   FL_WAIT_S      [300]               how long `up` waits for the application to answer
#   VENV           [.venv]             the virtual environment with ray and firstlight
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=${FL_CLUSTER_DIR:-/tmp/fl-two-node}
P=${FL_PORT:-6390}
HTTP=${FL_HTTP_PORT:-8000}
WAIT_S=${FL_WAIT_S:-300}
VENV=${VENV:-.venv}

# Ports: GCS P, dashboard P+1, Ray client P+2; each node: node manager, object manager,
# metrics, dashboard agent (HTTP, gRPC), runtime-env agent at +3..+8 (head) and +13..+18
# (node2), and its own range of worker ports, so nothing clashes with another Ray here.
node_ports() {  # $1: offset of the node's ports, $2: first worker port
  echo "--node-manager-port=$((P + $1)) --object-manager-port=$((P + $1 + 1))" \
    "--metrics-export-port=$((P + $1 + 2)) --dashboard-agent-listen-port=$((P + $1 + 3))" \
    "--dashboard-agent-grpc-port=$((P + $1 + 4)) --runtime-env-agent-port=$((P + $1 + 5))" \
    "--min-worker-port=$2 --max-worker-port=$(($2 + 99))"
}
# Every command after the export authenticates with the cluster's token; workers import this
# checkout; Ray nices its workers to 15 by default (see `make serve`).
ENV="export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$DIR/auth_token"' PYTHONPATH="$PWD" RAY_worker_niceness=0'
COMMON="--object-store-memory=209715200 --disable-usage-stats"

UP=(
  "$VENV/bin/python scripts/two_node.py token $DIR/auth_token"
  "$ENV"
  "$VENV/bin/python scripts/two_node.py config serve_config.yaml $DIR/serve_config.yaml --http-port=$HTTP"
  "$VENV/bin/ray start --head --port=$P --temp-dir=$DIR/head --num-cpus=1 --resources='{\"head\": 1}' $COMMON --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=$((P + 1)) --ray-client-server-port=$((P + 2)) $(node_ports 3 $((P + 100)))"
  "$VENV/bin/ray start --address=127.0.0.1:$P --temp-dir=$DIR/node2 --num-cpus=2 --resources='{\"node2\": 1}' $COMMON $(node_ports 13 $((P + 200)))"
  "$VENV/bin/serve deploy --address=http://127.0.0.1:$((P + 1)) $DIR/serve_config.yaml"
  "$VENV/bin/python scripts/two_node.py wait --http-port=$HTTP --dashboard-port=$((P + 1)) --timeout-s=$WAIT_S"
)
DOWN=(
  "$VENV/bin/python scripts/two_node.py stop $DIR --gcs-port=$P"
)

case "${1:-}" in
  up)
    trap 'echo "two_node.sh: that step failed; scripts/two_node.sh down stops what started" >&2' ERR
    for command in "${UP[@]}"; do
      echo "+ $command"
      eval "$command"
    done
    ;;
  down)
    for command in "${DOWN[@]}"; do
      echo "+ $command"
      eval "$command"
    done
    ;;
  print)
    printf '%s\n' "${UP[@]}" "${DOWN[@]}"
    ;;
  *)
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
