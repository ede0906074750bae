#!/usr/bin/env bash
# The GPU checks of the GPU path (issue 10's Show), run on a lent GPU machine in the repo root:
#
#   bash scripts/device_check.sh tests gpu      # tests/gpu + bench/gpu.py
#   bash scripts/device_check.sh serve          # demo build, a streamed chat from a GPU
#                                               # replica, bench/overhead.py on the GPU config
#
# Each call must end inside the `run` tool's 600 s: the stage timeouts below add up to 570 s
# per call (tests 150 + gpu 420; serve: demo 150 + stream 120 + stop 20 + overhead 270). A
# stage cut by its timeout leaves its log under $OUT; `GPU_ARGS="--only 8b"` halves bench/gpu.py.
#
# Before the first call, here: `.venv/bin/python scripts/device_wheels.py` (Ray, FastAPI,
# pydantic and the rest of the Serve path the device image lacks, 55 MiB), then each call
# carries `.whl` (the `run` tool's carry=[".whl"]); the demo models do not fit beside the
# wheels, so `serve` builds them there. Each stage writes its log (and JSON) under $OUT, and
# the last lines printed are a summary. GPU_ARGS passes options to bench/gpu.py (e.g.
# "--ablations", or "--only 8b"); a stage failing does not stop the next. A dry run of the
# stages here on the CPU: PY=.venv/bin/python SERVE_CONFIG=serve_config.yaml (no wheels).
set -uo pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests gpu serve)
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export FIRSTLIGHT_HOME=${FIRSTLIGHT_HOME:-/tmp/firstlight-home}
CONFIG=${SERVE_CONFIG:-serve_config.gpu.yaml}
HERE=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 \
  | tee "$OUT/gpu.txt"
if [ -n "${PY:-}" ]; then
  PATH=$(dirname "$PY"):$PATH
  export PATH
elif compgen -G ".whl/*.whl" >/dev/null; then
  PY=python3
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/*.whl >"$OUT/pip.log" 2>&1 || { echo "wheel install failed: $OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  PY=python3
  export PYTHONPATH=$PWD
  echo "no .whl/ carried: the serve stage needs Ray (scripts/device_wheels.py)"
fi
summary=()

run_tests() {
  # not `-m gpu`: test_decode_graphs.py and test_fused_ops.py are unmarked (on a CPU they run
  # under the interpreter)
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu \
    tests/engine/test_decode_graphs.py tests/kernels/test_fused_ops.py 2>&1 \
    | tee "$OUT/tests.log" | tail -25
  summary+=("tests: $(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/tests.log" | tail -1)")
}

run_gpu() {
  # shellcheck disable=SC2086  # GPU_ARGS is a list of options
  timeout 420 "$PY" bench/gpu.py ${GPU_ARGS:-} 2>"$OUT/gpu.err" | tee "$OUT/gpu.json" | tail -1
  tail -5 "$OUT/gpu.err"
  summary+=("bench/gpu.py: $("$PY" "$HERE/device_summary.py" gpu "$OUT/gpu.json")")
}

run_serve() {
  timeout 150 "$PY" -m demo.build --threads "$(nproc)" >"$OUT/demo.log" 2>&1 \
    || { summary+=("serve: demo build failed ($OUT/demo.log)"); return; }
  # `make serve` on a GPU host, minus its set-up
  RAY_worker_niceness=0 setsid serve run "$CONFIG" >"$OUT/serve.log" 2>&1 &
  local pid=$!
  summary+=("serve run $CONFIG: $(timeout 120 "$PY" "$HERE/device_summary.py" stream \
    "$OUT/stream.txt")")
  kill -INT -- -"$pid" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$pid" 2>/dev/null
  ray stop --force >/dev/null 2>&1
  grep -E "attention backend|layer ops|decode graphs" "$OUT/serve.log" | head -5
  timeout 270 "$PY" bench/overhead.py --config "$CONFIG" --ttft-requests 30 --itl-rounds 5 \
    2>"$OUT/overhead.err" | tee "$OUT/overhead.json" | tail -1
  summary+=("bench/overhead.py ($CONFIG): $(tail -1 "$OUT/overhead.json")")
}

for stage in "${stages[@]}"; do
  case $stage in
    tests) run_tests ;;
    gpu) run_gpu ;;
    serve) run_serve ;;
    *) echo "unknown stage $stage (tests, gpu, serve)"; exit 2 ;;
  esac
done
printf '%s\n' "--- summary" "${summary[@]}"
