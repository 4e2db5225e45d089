# `make demo` and `make test` do all the set-up on a fresh machine (a venv in .venv).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.layertap-installed

.PHONY: demo test examples bench setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# pinned torch first: these builds lie on the machine's disk; pip takes them from there
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[all,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/layertap demo --out layertap-demo

examples: $(STAMP)
	for e in examples/*.py; do $(BIN)/python $$e || exit 1; done

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done
