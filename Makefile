# firstlight — every target sets up what it needs first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.firstlight-setup
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# `make serve` on a GPU machine serves from one GPU (serve_config.gpu.yaml); SERVE_CONFIG=... overrides
SERVE_CONFIG ?= $(if $(HAS_GPU),serve_config.gpu.yaml,serve_config.yaml)

.PHONY: setup browser demo serve standalone screenshot load test test-fast lint bench bench-engine bench-overhead bench-routing bench-spec bench-batch bench-structured bench-policies clean

setup: $(STAMP) browser

# Headless Chromium and its WebDriver, for the playground's browser tests and `make screenshot`
# (Debian packages; installed once, as root, quietly). Without them those tests skip.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver (apt-get)"; \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else \
	    echo "no chromium: run 'apt-get install chromium chromium-driver' as root for the browser tests"; \
	  fi; }

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),)
	# CPU machine: the local CPU build of torch (any other pulls gigabytes of CUDA packages),
	# and Triton for the interpreter parity tests of our GPU kernels (tests/kernels; no CUDA
	# packages; a GPU machine uses the Triton its CUDA torch pins).
	$(PY) -m pip install -q torch==2.13.0 triton==3.9.0
endif
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(PY) -m demo.build

serve: setup demo
	@echo "firstlight: starting the demo model (the URL to open follows once it is up)"
	@echo "try: curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\":\"demo\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"Can I pause my annual subscription?\"}]}'"
	# Ray nices its workers to 15 by default; model replicas should not yield to everything.
	# The announcer prints the playground's URL once /health answers; `exec` gives `serve run`
	# this shell's pid, which the announcer watches so it leaves with it.
	$(PY) -m app.playground.announce --config $(SERVE_CONFIG) --while-pid $$$$ & \
	RAY_worker_niceness=0 exec $(VENV)/bin/serve run $(SERVE_CONFIG)

standalone: setup demo
	$(PY) -m app.standalone --config serve_config.yaml

# docs/playground.png: the playground mid-stream (bare mode, demo model, headless Chromium)
screenshot: setup demo
	$(PY) -m app.playground.screenshot docs/playground.png

# Locust against the server at LOAD_HOST (default http://127.0.0.1:8000, e.g. `make serve` in
# another terminal), or against bare mode started for the run when none answers; about 75 s.
# Report: bench/out/load-<time>/report.html (settings: LOAD_* variables, locustfiles/settings.py)
load: setup demo
	$(PY) -m locustfiles.run

test: setup demo
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not slow and not serve"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: bench-engine bench-overhead bench-routing

bench-engine: setup demo
	$(PY) bench/engine.py

bench-overhead: setup demo
	$(PY) bench/overhead.py

bench-routing: setup demo
	$(PY) bench/routing.py

bench-spec: setup demo
	$(PY) bench/spec.py

bench-batch: setup demo
	$(PY) bench/batch.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

bench-structured: setup demo
	$(PY) bench/structured.py

# Cluster policies on 2 replicas: interactive vs bulk, prefix-heavy routing, autoscaling (~10 min)
bench-policies: setup demo
	$(PY) bench/policies.py
