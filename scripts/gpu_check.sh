#!/usr/bin/env bash
# One prepared check of HeterMoE on one GPU with four real NCCL ranks (issue 43), within 8 minutes;
# one log with a SUMMARY block: $OUT/gpu_check.log when $OUT is set, else ./gpu_check.log, and
# gpu_check.json beside it (scripts/gpu_check/main.py describes the steps; docs/gpu-check.md the call).
#
#   scripts/gpu_check.sh                        # every step (GPU parts SKIP when no GPU is visible)
#   scripts/gpu_check.sh --dry-run              # CPU: gloo ranks instead of NCCL, the same harness; ~1 min
#   scripts/gpu_check.sh --steps zebra,resume   # some steps, by name; --budget SECONDS (default 430), --log FILE
#
# On the device machine (no registry: the wheels travel in .whl, gathered here by `make gpu-wheels`;
# carry [".whl"], timeout_s 600):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHON=python3 scripts/gpu_check.sh
# Exit status: 0 when no step FAILed.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check/main.py "$@"
