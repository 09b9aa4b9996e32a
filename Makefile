# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first, from the CPU build: otherwise megatron-core pulls a multi-GB CUDA torch.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q pybind11 setuptools wheel
	$(BIN)/pip install -q --no-build-isolation -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python scripts/demo.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info megatron_hetermoe/_csim*.so
