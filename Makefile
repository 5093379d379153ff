# Quick start (fresh Debian machine, as root):
#   make demo   # set up and run `sentinel demo` on embedded defaults
#   make test   # set up (incl. Debian redis-server, prometheus, alertmanager) and run the whole suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=
# xdist workers for `make test` (0: one process, no xdist). 3 on 2 cores: most tests wait on another process, and a
# third worker fills that time (docs/testing.md: 9:57 against 11:19 with 2)
TEST_WORKERS ?= 3

.PHONY: demo test setup setup-system clean

EXTRAS  := test,dashboards,train,demo,embedded,report,hf,lightning
# uv installs the same pins as pip in seconds instead of a minute (INSTALLER=pip: pip only). uv reads no pip
# config, so it gets pip's find-links: a machine's local wheels (here the CPU build of torch)
INSTALLER ?= uv
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch pinned in the same call, so that nothing pulls multi-GB CUDA builds; pip is the fallback. Bytecode is
	# compiled at install, as pip does: without it every process the suite starts compiles torch again (18 min, not 11)
	if [ "$(INSTALLER)" = uv ] && $(BIN)/pip install -qq uv && \
	   $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $(foreach f,$(FIND_LINKS),--find-links $(f)) \
	     $(TORCH) numpy -e '.[$(EXTRAS)]'; then :; else \
	  $(BIN)/pip install -q $(TORCH) numpy && $(BIN)/pip install -q -e '.[$(EXTRAS)]'; fi
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
