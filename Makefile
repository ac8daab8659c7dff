# The two set-up commands are `make demo` and `make test`: each creates the virtual
# environment and installs what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo test test-postgresql lint bench bench-full chaos protos image image-cuda docker-engine clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "edge-offload needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

venv: $(STAMP)  ## create .venv and install (what every other target does first)

demo: $(STAMP)  ## a whole edge cloud on this machine, a client moving (ARGS="--quick --keep ...")
	$(VENV)/bin/offload demo $(ARGS)

test: $(STAMP)  ## run every test (Docker tests skip without an engine, fail under CI=true)
	$(PY) -m pytest

test-postgresql: $(STAMP)  ## the tests that start clusters, their brokers' state on PostgreSQL
	OFFLOAD_TEST_STATE=postgresql $(PY) -m pytest tests/integration tests/e2e

lint: $(STAMP)  ## ruff check, ruff format --check, mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(STAMP)  ## every benchmark, short mode; figures beside their baselines
	$(PY) -m bench --quick

bench-full: $(STAMP)  ## every benchmark, full mode
	$(PY) -m bench

chaos: $(STAMP)  ## faults and hostile input on a loopback cluster, short mode (ARGS="--scenarios ...")
	$(PY) -m bench.chaos --quick $(ARGS)

protos: $(STAMP)  ## regenerate the committed gRPC/protobuf code
	$(PY) -m protos.generate

image: $(STAMP)  ## build the cpu runtime image (cached by content)
	$(VENV)/bin/offload image build --variant cpu

image-cuda: $(STAMP)  ## build the cuda runtime image (several GB of wheels)
	$(VENV)/bin/offload image build --variant cuda

docker-engine:  ## install and start Debian's Docker engine (root; for machines without one)
	@if docker info >/dev/null 2>&1; then echo "a Docker engine is already running"; exit 0; fi; \
	command -v dockerd >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io; }; \
	nohup dockerd >/var/log/dockerd.log 2>&1 & \
	for i in $$(seq 60); do docker info >/dev/null 2>&1 && { echo "Docker engine ready"; exit 0; }; sleep 1; done; \
	echo "dockerd did not come up; see /var/log/dockerd.log"; exit 1

clean:  ## remove the virtual environment and caches (not the model/image cache)
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
