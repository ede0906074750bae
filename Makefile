# firstlight — every target sets up what it needs first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.firstlight-setup
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup demo serve standalone test test-fast lint bench bench-engine bench-overhead bench-routing bench-spec clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),)
	# CPU machine: the local CPU build of torch (any other pulls gigabytes of CUDA packages).
	$(PY) -m pip install -q torch==2.13.0
endif
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(PY) -m demo.build

serve: setup demo
	@echo "firstlight: serving the demo model at http://127.0.0.1:8000/v1"
	@echo "try: curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\":\"demo\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"Can I pause my annual subscription?\"}]}'"
	# Ray nices its workers to 15 by default; model replicas should not yield to everything.
	RAY_worker_niceness=0 $(VENV)/bin/serve run serve_config.yaml

standalone: setup demo
	$(PY) -m app.standalone --config serve_config.yaml

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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
