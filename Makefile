# Two entry points: `make serve` (the service with the shipped model) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test bench install clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q numpy==2.4.6
	$(BIN)/pip install -q -e ".[cpu,serve,train,dev]"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/enhancer serve --host $(HOST) --port $(PORT)

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

# The browser demo's test needs Chromium: install Debian's package when missing and we are root.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed: the browser demo test will not run"

bench: $(STAMP)
	$(BIN)/enhancer bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
