#!/usr/bin/env bash
# Submit a HeterMoE training job to SLURM: each GPU type of the plan is one component of a
# heterogeneous job, one task per GPU, and every plan rank runs on a node of its GPU type.
#
#   scripts/slurm/launch.sh [--dry-run] --plan plan.json --gpus-per-node 8 \
#       [--gpus-per-node v100=4] [--partition a40=gpu-a40] [--constraint v100=v100-32g] \
#       [--account ACC] [--time 02:00:00] [--master-port 29500] \
#       [--entry plugin | --entry megatron-lm --megatron-lm-dir DIR | --entry megatron-core] \
#       [--cuda-device-max-connections 8] \
#       -- <pretrain_gpt flags: --num-layers ... --data-path ...>
#
# --dry-run prints the sbatch command, the batch script and every task's command, and submits nothing.
# Relative paths (--plan, the flags') mean the current directory, where the job runs. $PYTHON is the
# interpreter here and in every task. The flags are checked before the script is written.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "${here}/../.." && pwd)"
python="${PYTHON:-python3}"
dry_run=0
args=()
for a in "$@"; do
    if [[ "${a}" == "--dry-run" ]]; then
        dry_run=1
    else
        args+=("${a}")
    fi
done
if (( ${#args[@]} == 0 )); then
    sed -n '2,13p' "${BASH_SOURCE[0]}" >&2
    exit 2
fi
render() {
    PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}" "${python}" -m megatron_hetermoe.tools.slurm \
        --repo "${repo}" --workdir "${PWD}" --python "${python}" "$@"
}
if (( dry_run )); then  # nothing is written: the script and each task's command go to stdout
    rendered="$(render --with-tasks "${args[@]}")"
    echo "# dry run: would submit (sbatch SCRIPT) this batch script"
    printf '%s\n' "${rendered}"
    exit 0
fi
# Render first: a bad plan or flag stops here, before anything is written or submitted.
rendered="$(render "${args[@]}")"
if ! command -v sbatch > /dev/null; then
    echo "launch.sh: sbatch not found: run this on a SLURM login node (or use --dry-run)" >&2
    exit 1
fi
# sbatch copies the script at submission: a temporary file, removed however this script ends.
out_dir="${HETERMOE_SLURM_DIR:-${TMPDIR:-/tmp}}"
mkdir -p "${out_dir}"
script="$(mktemp "${out_dir}/hetermoe-XXXXXX.sbatch")"
trap 'rm -f "${script}"' EXIT
printf '%s\n' "${rendered}" > "${script}"
sbatch "${script}"
