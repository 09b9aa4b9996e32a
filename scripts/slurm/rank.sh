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
# LOCAL_RANK is the GPU a rank takes (Megatron-LM: set_device(args.local_rank)). The batch script
# lets every task see all GPUs of its node (--gpu-bind=none): then it is the task's index on the
# node. Where the site still gives a task one GPU, that GPU is device 0.
LOCAL_RANK="${SLURM_LOCALID:?rank.sh runs under srun}"
IFS=',' read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
if (( ${#visible[@]} == 1 )) && [[ -n "${visible[0]}" ]]; then
    LOCAL_RANK=0
fi
export RANK LOCAL_RANK
: "${WORLD_SIZE:?set by the batch script}" "${MASTER_ADDR:?set by the batch script}" "${MASTER_PORT:?set by the batch script}"
if [[ "${CUDA_DEVICE_MAX_CONNECTIONS:-}" == "1" ]] && (( RANK == 0 )); then
    echo "rank.sh: CUDA_DEVICE_MAX_CONNECTIONS=1 serialises the CUDA streams zebra overlaps on" >&2
fi
exec "$@"
