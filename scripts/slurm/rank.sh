#!/usr/bin/env bash
# One task of a HeterMoE SLURM job (started by the srun line of launch.sh's batch script):
# turn SLURM's task number into the plan rank, then run the training command given as arguments.
# Tasks are numbered component by component; HETERMOE_RANK_MAP lists the plan rank of each.
set -euo pipefail
read -r -a rank_map <<< "${HETERMOE_RANK_MAP:?set by the batch script that launch.sh writes}"
procid="${SLURM_PROCID:?rank.sh runs under srun}"
if (( procid >= ${#rank_map[@]} )); then
    echo "rank.sh: task ${procid} but the rank map has ${#rank_map[@]} ranks; the allocation does not match the plan" >&2
    exit 1
fi
RANK="${rank_map[$procid]}"
LOCAL_RANK="${SLURM_LOCALID:?rank.sh runs under srun}"
export RANK LOCAL_RANK
: "${WORLD_SIZE:?set by the batch script}" "${MASTER_ADDR:?set by the batch script}" "${MASTER_PORT:?set by the batch script}"
exec "$@"
