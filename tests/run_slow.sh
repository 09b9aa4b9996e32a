#!/usr/bin/env bash
# `make test-slow`: the tests marked slow, in parts run side by side, each its own pytest session
# (its own --basetemp; no shared cache), their outputs shown one after the other once all end.
# Most slow tests start several processes that wait on each other (rendezvous, collectives,
# checkpoints): one session keeps about half of 2 cores busy. The parts: the tests of Megatron-LM's
# pretrain() (tests/training) but a few files, and the rest with those few last (by the durations of
# 063f23b alone: 1,670 s and 1,679 s; `make slow-deps` compiles the checkout's dataset helpers, which
# each session's first pretrain() would otherwise build). Exit status: nonzero if any part failed.
#   tests/run_slow.sh PYTHON [pytest args...]
set -u
py=${1:?usage: tests/run_slow.sh PYTHON [pytest args...]}
shift
cd "$(dirname "$0")/.." || exit 2
out=$(mktemp -d)
# tests/training files run in the second part (pytest's --ignore would drop them even when named)
later=(tests/training/test_megatron_lm_pp.py tests/training/test_megatron_lm_tp.py tests/training/test_megatron_lm_mtp.py)
first="tests/training"
rest="tests"
for f in tests/training/test_*.py; do
  if [[ " ${later[*]} " == *" $f "* ]]; then first+=" --deselect $f"; else rest+=" --deselect $f"; fi
done
parts=("$first" "$rest")
pids=()
for i in "${!parts[@]}"; do
  # shellcheck disable=SC2086  # a part is a list of pytest arguments
  OMP_NUM_THREADS=1 "$py" -m pytest -q -p no:cacheprovider --basetemp="$out/tmp$i" --durations=40 -m slow \
    ${parts[$i]} "$@" > "$out/part$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  code=$?
  echo "==== slow tests, part $((i + 1)) of ${#parts[@]} (pytest ${parts[$i]}): exit $code ===="
  cat "$out/part$i.log"
  [ "$code" -eq 0 ] || [ "$code" -eq 5 ] || rc=1  # 5: nothing collected (a part with no slow test)
done
if [ "$rc" -eq 0 ]; then rm -rf "$out"; else echo "the parts' logs and temporary files: $out"; fi
exit $rc
