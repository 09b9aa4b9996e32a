#!/usr/bin/env bash
# One prepared check of HeterMoE on one GPU, about 7 minutes, one log with a SUMMARY block:
# $OUT/gpu_check.log when $OUT is set, else ./gpu_check.log (scripts/gpu_check/main.py describes
# the steps).
#
#   scripts/gpu_check.sh              # all steps (GPU ones SKIP when no GPU is visible)
#   scripts/gpu_check.sh --dry-run    # CPU only: tiny sizes, CPU references, GPU-only steps SKIP
#   scripts/gpu_check.sh --steps 1,2  # some steps; --budget SECONDS (default 430), --log FILE
#
# On the device machine (megatron-core travels as a wheel in .whl; carry it):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && scripts/gpu_check.sh
# Exit status: 0 when no step FAILED.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check/main.py "$@"
