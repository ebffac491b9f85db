# Two entry points: `make serve` (the service with the shipped model) and `make test`.
# `make serve` installs only what serving needs (extras cpu,serve: no torch); `make test` adds the
# rest (train,dev) to the same environment. Each is installed once per pyproject.toml (a stamp in
# the venv named by its checksum), so `make serve` after `make test` installs nothing.
# `make bench-peers`: the model next to peer denoisers, in a venv of their own (.venv-peers).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
SUM     = $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
SERVE_STAMP = $(VENV)/.installed-serve-$(SUM)
TEST_STAMP  = $(VENV)/.installed-test-$(SUM)
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test test-cluster bench bench-peers install install-serve clean browser haproxy gpu-check

$(SERVE_STAMP): pyproject.toml
	@echo "installing tim-enhancer for serving into $(VENV) (editable, extras cpu,serve: no torch)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q numpy==2.4.6
	$(BIN)/pip install -q -e ".[cpu,serve]"
	rm -f $(VENV)/.installed-*
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	@echo "adding the training and test dependencies to $(VENV) (extras train,dev)"
	$(BIN)/pip install -q -e ".[cpu,serve,train,dev]"
	touch $@

install-serve: $(SERVE_STAMP)

install: $(TEST_STAMP)

serve: $(SERVE_STAMP)
	@echo "serving on http://$(HOST):$(PORT)/ (browser demo; REST at /v1/enhance, docs at /docs, health at /healthz)"
	$(BIN)/enhancer serve --host $(HOST) --port $(PORT)

test: $(TEST_STAMP) browser haproxy
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The browser demo's test needs Chromium: install Debian's package when missing and we are root
# (system-wide, with apt-get: it says so first). NO_BROWSER_INSTALL=1 skips it (the test is then skipped).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ -z "$(NO_BROWSER_INSTALL)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		echo "make test: installing Debian's chromium system-wide with apt-get (for the browser demo test; NO_BROWSER_INSTALL=1 skips this)" && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && \
		echo "make test: chromium installed at $$(command -v chromium)"; } || \
		echo "chromium is not installed: the browser demo test will not run"

# The scale-out test (tests/cluster): three replicas behind Debian's haproxy on loopback, about 2 minutes.
# haproxy (also for `make test`: deploy/haproxy.cfg checked, and a stream and an upload through its TLS
# bind) is installed like chromium above (root and apt-get; NO_HAPROXY_INSTALL=1 skips it: those tests are then skipped).
test-cluster: $(TEST_STAMP) haproxy
	$(BIN)/python -m pytest -q -s -m cluster tests/cluster

haproxy:
	@command -v haproxy >/dev/null 2>&1 || { [ -z "$(NO_HAPROXY_INSTALL)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		echo "make: installing Debian's haproxy system-wide with apt-get, for the HAProxy tests (NO_HAPROXY_INSTALL=1 skips this)" && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null && \
		systemctl disable --now haproxy >/dev/null 2>&1; \
		echo "make: haproxy installed at $$(command -v haproxy)"; } || \
		echo "haproxy is not installed: the HAProxy tests (TLS, cluster) will be skipped"

bench: $(SERVE_STAMP)
	$(BIN)/enhancer bench

# Peers (the [bench] extra) never enter .venv: they go to .venv-peers, one by one with the core
# pins held, so a peer that cannot install (or would move numpy/onnxruntime) is reported and skipped.
PEERS_VENV  ?= .venv-peers
PEERS_BIN    = $(PEERS_VENV)/bin
PEERS_STAMP  = $(PEERS_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
CORE_PINS    = numpy==2.4.6 onnxruntime==1.31.1
BENCH_NOISY ?= ../shared/data/dev/valentini_p287/noisy
BENCH_CLEAN ?= ../shared/data/dev/valentini_p287/clean
BENCH_OUT   ?= runs/bench-peers
BENCH_ARGS  ?=

$(PEERS_STAMP): pyproject.toml
	test -x $(PEERS_BIN)/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/pip install -q --upgrade pip
	$(PEERS_BIN)/pip install -q $(CORE_PINS)
	$(PEERS_BIN)/pip install -q -e ".[cpu,train]"
	@failed=""; \
	for req in $$($(PEERS_BIN)/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"]))'); do \
		echo "installing $$req"; \
		$(PEERS_BIN)/pip install -q "$$req" $(CORE_PINS) || failed="$$failed $$req"; \
	done; \
	echo "$$failed" > $(PEERS_VENV)/install-failures.txt; \
	if [ -n "$$failed" ]; then echo "bench-peers: could not install:$$failed (reported as not installed)"; fi
	rm -f $(PEERS_VENV)/.installed-*
	touch $@

bench-peers: $(PEERS_STAMP)
	$(PEERS_BIN)/python -m training.peers --noisy $(BENCH_NOISY) --clean $(BENCH_CLEAN) --out $(BENCH_OUT) $(BENCH_ARGS)

# `make gpu-check`: the model and the service under CUDA, measured (tools/gpu_check.py), with
# the machine's own python3 and CUDA 13 libraries (the nvidia-* Python packages: onnxruntime's
# preload_dlls finds them). onnxruntime-gpu and the serving dependencies go to $(GPU_SITE): from
# $(GPU_CARRY) when it holds them (a machine without a package index: onnxruntime-gpu as
# onnxruntime-gpu.tar.xz.part* and wheels/*.whl, made by `python -m tools.gpu_carry`), else
# from the index. Results: $(GPU_OUT)/gpu-check.json.
GPU_CARRY ?= gpu-serve
GPU_SITE  ?= /tmp/tim-gpu-site
GPU_OUT   ?= runs/gpu-check
GPU_ARGS  ?=

gpu-check:
	@set -e; rm -rf $(GPU_SITE); mkdir -p $(GPU_SITE); \
	if ls $(GPU_CARRY)/onnxruntime-gpu.tar.xz.part* >/dev/null 2>&1; then \
		echo "gpu-check: onnxruntime-gpu from $(GPU_CARRY)"; \
		cat $(GPU_CARRY)/onnxruntime-gpu.tar.xz.part* | $(PYTHON) -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='data')" $(GPU_SITE); \
	else \
		$(PYTHON) -m pip install -q --target $(GPU_SITE) $$($(PYTHON) -c "import tomllib; e = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(e['gpu']))"); \
	fi; \
	if ls $(GPU_CARRY)/wheels/*.whl >/dev/null 2>&1; then \
		$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) $(GPU_CARRY)/wheels/*.whl; \
	else \
		$(PYTHON) -m pip install -q --target $(GPU_SITE) $$($(PYTHON) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(' '.join(r.split(';')[0].strip() for r in p['dependencies'] + p['optional-dependencies']['serve']))") httpx==0.28.1; \
	fi; \
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(PYTHON) -m tools.gpu_check --out $(GPU_OUT) $(GPU_ARGS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info .pytest_cache
