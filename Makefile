# shopsimrl — common tasks. `make install` once, then `make demo` / `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed

.PHONY: install test demo smoke reduce status clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its test extras

test: $(STAMP)  ## run the whole test suite (the README's test command)
	$(BIN)/pytest -q

demo: $(STAMP)  ## the heuristic policy on 120 val episodes against the local testbed
	BIN=$(BIN) scripts/testbed-run.sh configs/testbed_demo.yaml

smoke: $(STAMP)  ## 3 episodes against the local testbed
	BIN=$(BIN) scripts/testbed-run.sh configs/smoke.yaml

reduce: $(STAMP)  ## merge the shards of RUN=<uri> into summary.json
	@test -n "$(RUN)" || { echo "usage: make reduce RUN=<run uri>"; exit 2; }
	$(BIN)/shopsimrl reduce $(RUN)

status: $(STAMP)  ## per-shard progress of RUN=<uri>
	@test -n "$(RUN)" || { echo "usage: make status RUN=<run uri>"; exit 2; }
	$(BIN)/shopsimrl status $(RUN)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
