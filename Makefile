# Quick start (fresh Debian machine, as root):
#   make demo   # set up and run `sentinel demo` on embedded defaults
#   make test   # set up (incl. Debian redis-server, prometheus, alertmanager) and run the whole suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=
# xdist workers for `make test` (0: one process, no xdist)
TEST_WORKERS ?= 2

.PHONY: demo test setup setup-system clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the local CPU wheel first, so nothing pulls multi-GB CUDA builds
	$(BIN)/pip install -q $(TORCH) numpy
	$(BIN)/pip install -q -e '.[test,dashboards,train,demo,embedded,report,hf,lightning]'
	touch $@

setup: $(BIN)/.installed

# Debian packages the real-service tests use (the demo needs none: its bus is embedded)
setup-system:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	  command -v promtool >/dev/null || missing="$$missing prometheus"; \
	  command -v prometheus-alertmanager >/dev/null || missing="$$missing prometheus-alertmanager"; \
	  command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	  [ -d /usr/share/doc/python3.11/html/_sources ] || missing="$$missing python3.11-doc"; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	  systemctl disable --now redis-server prometheus prometheus-alertmanager >/dev/null 2>&1 || true; \
	else echo "note: not root or no apt-get; install redis-server, prometheus, prometheus-alertmanager, python3.11-doc yourself"; fi

demo: setup
	$(BIN)/sentinel demo

test: setup setup-system
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# the fast tier for the edit loop (<= 90 s, docs/testing.md): in-process tests only; tests/conftest.py marks
# every test that starts a service or another process `slow`, and `make test` runs those too
.PHONY: check
check: setup
	$(BIN)/python -m pytest -m "not slow" -q $(PYTEST_ARGS)
