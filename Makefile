# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The exact versions tested here; setup.py itself only states ranges.
CONSTRAINTS := constraints/ci.txt
PIP_INSTALL := $(BIN)/pip install -q -c $(CONSTRAINTS)

.PHONY: demo test test-slow slow-deps test-slow-run test-all test-install install wheel clean lint

$(STAMP): setup.py pyproject.toml $(CONSTRAINTS)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first, from the CPU build: otherwise megatron-core pulls a multi-GB CUDA torch.
	$(PIP_INSTALL) torch==2.13.0
	# Build requirements (pyproject.toml), for the editable build without isolation.
	$(PIP_INSTALL) pybind11 setuptools wheel
	$(PIP_INSTALL) --no-build-isolation -e '.[dev,plot]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python scripts/demo.py

# `make test`: every test not marked slow (minutes). `make test-slow`: the slow ones (multi-process
# parity runs, the installed wheel and, with MEGATRON_LM_DIR (a Megatron-LM checkout), Megatron-LM's
# own pretrain(), which needs its training-side packages: the megatron-lm extra, triton alone ~1 GB,
# so only then). CI runs both; `make test-all` is both in one pytest run.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15 -m "not slow" tests

# The slow tests run in parts side by side (tests/run_slow.sh: each part's session leaves cores idle).
test-slow: slow-deps
	$(MAKE) --no-print-directory test-slow-run

# With MEGATRON_LM_DIR: the megatron-lm extra, and the checkout's dataset helpers built once (what
# Megatron-LM's first pretrain() builds with `make`, with this interpreter's pybind11 and python3-config),
# before the parts of tests/run_slow.sh could build them at once.
slow-deps: $(STAMP)
	if [ -n "$$MEGATRON_LM_DIR" ]; then $(PIP_INSTALL) --no-build-isolation -e '.[megatron-lm]'; fi
	if [ -f "$$MEGATRON_LM_DIR/megatron/core/datasets/Makefile" ]; then \
		PATH="$(abspath $(BIN)):$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("BINDIR"))'):$$PATH" \
		$(MAKE) -s -C "$$MEGATRON_LM_DIR/megatron/core/datasets"; fi

# The slow tests without the install step (CI installs first: editable installs rewrite the
# source tree's egg-info, which a running test may read).
test-slow-run:
	bash tests/run_slow.sh $(BIN)/python

test-all: $(STAMP)
	if [ -n "$$MEGATRON_LM_DIR" ]; then $(PIP_INSTALL) --no-build-isolation -e '.[megatron-lm]'; fi
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=30 tests

# pycodestyle errors and warnings at 120 columns, pyflakes' checks (unused names, undefined names) and
# syntax errors; settings in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check megatron_hetermoe tests scripts

# The wheel, installed into a fresh venv and run from outside the checkout (part of `make test-slow`).
test-install: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_install.py

wheel: $(STAMP)
	$(BIN)/pip wheel -q --no-deps -w dist .

clean:
	rm -rf $(VENV) build dist *.egg-info megatron_hetermoe/_csim*.so

# ---- compat: the plugin on megatron-core 0.19.x (issue 13). `make compat` is not part of CI; test-v019 is. ----
# .venv-compat: Python 3.12 from pyenv (found, never downloaded; or COMPAT_PY=/path/to/python3.12),
# megatron-core $(COMPAT_MCORE) and the torch the registry resolves for it (a multi-GB CUDA build
# that also runs on CPU; downloaded once), then the parity, zebra, checkpoint, golden, CPU-backend
# and patch tests there. MEGATRON_LM_DIR=/path/to/Megatron-LM (core_v0.19.0) also runs the patch
# tests and Megatron-LM's own pretrain() with --hetero-plan against that checkout. Results:
# docs/compatibility.md; what differs: megatron_hetermoe/compat.py.
COMPAT_VENV := .venv-compat
COMPAT_MCORE ?= 0.19.2
COMPAT_PY ?= $(shell p=$$(pyenv prefix 3.12 2>/dev/null) && echo $$p/bin/python3.12 || command -v python3.12)
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(COMPAT_MCORE)
COMPAT_TESTS := tests/integration/test_distep_parity.py tests/integration/test_pp_parity.py tests/integration/test_zebra.py tests/integration/test_checkpoint.py \
	tests/training/test_golden.py tests/parallel/test_cpu_backend.py tests/training/test_patches.py tests/test_compat.py \
	tests/training/test_megatron_lm_v019.py tests/training/test_hetermoe_pretrain.py

.PHONY: compat

$(COMPAT_STAMP): setup.py pyproject.toml
	@test -n "$(COMPAT_PY)" || { echo "make compat: no Python 3.12 found (pyenv prefix 3.12, python3.12); set COMPAT_PY" >&2; exit 2; }
	test -d $(COMPAT_VENV) || $(COMPAT_PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q pybind11 setuptools wheel
	# No torch first: megatron-core's requirement brings the registry's (CUDA) torch, as users get it.
	$(COMPAT_VENV)/bin/pip install -q --no-build-isolation 'megatron-core==$(COMPAT_MCORE)' -e '.[dev,plot]'
	touch $@

# CI's second line (.ci/run): Megatron-LM core_v0.19.0's own pretrain() on megatron-core $(COMPAT_MCORE)
# (MEGATRON_LM_DIR: a core_v0.19.0 tree), and `hetermoe pretrain` with no checkout; a test that
# cannot run there fails instead of skipping (HETERMOE_REQUIRE_V019).
# On 0.19 too, the plugin trainer's tests that found 0.19-only bugs: the core test's 2x(2+2) case (its
# gradient-norm check: HeterMoE's norm counted every copy of a gradient, a method megatron-core renamed),
# the distributed optimizer with an Asym-EA rank (a hang: 0.19 all-gathers each sub-optimizer's buckets
# unless deferred) and the live moves.
V019_TESTS := tests/training/test_megatron_lm_v019.py tests/training/test_hetermoe_pretrain.py \
	'tests/integration/test_distep_parity.py::test_distep_matches_megatron_ep[2x(2+2)-2]' \
	tests/integration/test_distributed_optimizer.py tests/integration/test_live_moves.py
.PHONY: test-v019 test-v019-run compat-env compat-deps
# The download of .venv-compat's megatron-core and its (CUDA) torch, nothing of this project built:
# CI runs it while its first line tests (.ci/run), the download overlapping CPU-bound tests.
compat-deps:
	@test -n "$(COMPAT_PY)" || { echo "make compat-deps: no Python 3.12 found (pyenv prefix 3.12, python3.12); set COMPAT_PY" >&2; exit 2; }
	test -d $(COMPAT_VENV) || $(COMPAT_PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q pybind11 setuptools wheel 'megatron-core==$(COMPAT_MCORE)'

# .venv-compat with Megatron-LM's training side: what test-v019 runs in.
compat-env: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/pip install -q --no-build-isolation 'megatron-core==$(COMPAT_MCORE)' -e '.[megatron-lm]'

test-v019: compat-env
	$(MAKE) --no-print-directory test-v019-run

# test-v019 without the install step (CI installs first, then runs this beside the slow tests).
test-v019-run:
	@test -n "$$MEGATRON_LM_DIR" || { echo "make test-v019: set MEGATRON_LM_DIR to a Megatron-LM core_v0.19.0 tree" >&2; exit 2; }
	HETERMOE_REQUIRE_V019=1 OMP_NUM_THREADS=1 $(COMPAT_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider \
		--durations=15 $(V019_TESTS)

# With MEGATRON_LM_DIR (a core_v0.19.0 checkout) Megatron-LM's own pretrain() runs too
# (test_megatron_lm_v019.py): its training side needs the megatron-lm extra.
compat: $(COMPAT_STAMP)
	if [ -n "$$MEGATRON_LM_DIR" ]; then $(COMPAT_VENV)/bin/pip install -q --no-build-isolation 'megatron-core==$(COMPAT_MCORE)' -e '.[megatron-lm]'; fi
	@$(COMPAT_VENV)/bin/python -c "import sys, torch, megatron.core as m; print('compat: Python', sys.version.split()[0], '| torch', torch.__version__, '| megatron-core', m.__version__)" 2>/dev/null
	OMP_NUM_THREADS=1 $(COMPAT_VENV)/bin/python -m pytest -q -rs $(COMPAT_TESTS)

# ---- canary: Megatron-LM main (megatron-core 0.20.0 in development; issue 45). Not in CI's required line. ----
# `make canary-main` extracts the main snapshot kept beside the repository (../shared/megatron-lm/, or
# CANARY_DIR=/path/to/a Megatron-LM main tree), installs its megatron-core from that tree into .venv-canary
# (Python 3.12, the registry's torch), this package without its megatron-core<0.20 pin, and runs the
# core_v0.19.0 line's pretrain() tests against it (HETERMOE_CANARY_MAIN=1: the tests take release line
# 0.20 and patches/megatron-lm-core_v0.20.0-pretrain_gpt.patch). What broke and why: docs/compatibility.md.
CANARY_VENV := .venv-canary
CANARY_TARBALL ?= $(firstword $(wildcard ../shared/megatron-lm/Megatron-LM-main-*.tar.gz))
CANARY_DIR ?= $(if $(CANARY_TARBALL),.ci-work/$(patsubst %.tar.gz,%,$(notdir $(CANARY_TARBALL))))
CANARY_DEPS := einops numpy psutil pyyaml tokenizers matplotlib tensorboard pytest hypothesis pytest-timeout six regex pydantic
.PHONY: canary-main
canary-main:
	@test -n "$(COMPAT_PY)" || { echo "make canary-main: no Python 3.12 found (pyenv prefix 3.12, python3.12); set COMPAT_PY" >&2; exit 2; }
	@test -n "$(CANARY_DIR)" || { echo "make canary-main: no ../shared/megatron-lm/Megatron-LM-main-*.tar.gz; set CANARY_DIR to a Megatron-LM main tree" >&2; exit 2; }
	test -d $(CANARY_DIR) || { mkdir -p .ci-work && tar -xzf $(CANARY_TARBALL) -C .ci-work; }
	test -d $(CANARY_VENV) || $(COMPAT_PY) -m venv $(CANARY_VENV)
	$(CANARY_VENV)/bin/pip install -q pybind11 setuptools wheel
	$(CANARY_VENV)/bin/pip install -q -e $(CANARY_DIR) $(CANARY_DEPS)
	$(CANARY_VENV)/bin/pip install -q --no-build-isolation --no-deps -e .
	PATH="$(abspath $(CANARY_VENV))/bin:$$PATH" HETERMOE_CANARY_MAIN=1 MEGATRON_LM_DIR="$(abspath $(CANARY_DIR))" \
		OMP_NUM_THREADS=1 $(CANARY_VENV)/bin/python -m pytest -q -rs -W ignore $(V019_TESTS)

# ---- the one-GPU check's wheels (issue 43): what scripts/gpu_check.sh needs on a GPU machine that has
# Python 3.12 and torch but no megatron-core and no package registry (docs/gpu-check.md). Downloads, never
# installs: megatron-core's cp312 manylinux wheel and pydantic with what it needs (Megatron-LM's training
# side imports it; the device image lacks it), at the versions constraints/ci.txt pins, and Megatron-LM
# core_v0.16.1's tree as a tarball (MEGATRON_LM_TARBALL, else made from MEGATRON_LM_DIR). Carry .whl.
GPU_WHEELS_DIR := .whl
GPU_WHEELS := megatron-core pydantic pydantic_core annotated-types typing-inspection typing_extensions
GPU_WHEELS_PIP ?= $(if $(wildcard $(BIN)/pip),$(BIN)/pip,$(PY) -m pip)
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64)
MEGATRON_LM_TARBALL ?= ../shared/megatron-lm/Megatron-LM-core_v0.16.1.tar.gz
.PHONY: gpu-wheels
gpu-wheels:
	mkdir -p $(GPU_WHEELS_DIR)
	$(GPU_WHEELS_PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS_DIR) \
		$(foreach w,$(GPU_WHEELS),$(shell grep -i '^$(w)==' $(CONSTRAINTS) || echo 'gpu-wheels: $(w) is not pinned in $(CONSTRAINTS)' >&2))
	if [ -f "$(MEGATRON_LM_TARBALL)" ]; then install -m 644 "$(MEGATRON_LM_TARBALL)" $(GPU_WHEELS_DIR)/Megatron-LM-core_v0.16.1.tar.gz; \
	elif [ -n "$$MEGATRON_LM_DIR" ]; then tar -czf $(GPU_WHEELS_DIR)/Megatron-LM-core_v0.16.1.tar.gz --exclude='*.so' \
		--exclude=__pycache__ --exclude=.git -C "$$(dirname "$$MEGATRON_LM_DIR")" "$$(basename "$$MEGATRON_LM_DIR")"; \
	else echo "gpu-wheels: no Megatron-LM tree (MEGATRON_LM_TARBALL=$(MEGATRON_LM_TARBALL) is absent, MEGATRON_LM_DIR unset): the check's pretrain step will say it is missing" >&2; fi
	ls -l $(GPU_WHEELS_DIR); du -sh $(GPU_WHEELS_DIR)
