#!/usr/bin/env bash
# Submit a HeterMoE training job to SLURM: each GPU type of the plan is one component of a
# heterogeneous job, one task per GPU, and every plan rank runs on a node of its GPU type.
#
#   scripts/slurm/launch.sh [--dry-run] --plan plan.json --gpus-per-node 8 \
#       [--gpus-per-node v100=4] [--partition a40=gpu-a40] [--constraint v100=v100-32g] \
#       [--account ACC] [--time 02:00:00] -- <pretrain_gpt flags: --num-layers ... --data-path ...>
#
# --dry-run prints the sbatch command, the batch script and every task's command, and submits nothing.
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
    sed -n '2,10p' "${BASH_SOURCE[0]}" >&2
    exit 2
fi
# sbatch copies the script at submission, so a temporary file is enough.
out_dir="${HETERMOE_SLURM_DIR:-${TMPDIR:-/tmp}}"
mkdir -p "${out_dir}"
# Render first: a bad plan or flag stops here, before any file is written.
rendered="$(cd "${repo}" && "${python}" -m megatron_hetermoe.tools.slurm --repo "${repo}" "${args[@]}")"
script="$(mktemp "${out_dir}/hetermoe-XXXXXX.sbatch")"
printf '%s\n' "${rendered}" > "${script}"
if (( dry_run )); then
    echo "# dry run: would submit"
    echo "sbatch ${script}"
    echo "# ---- ${script}"
    cat "${script}"
    echo "# ---- what each task runs (rank.sh resolves RANK from SLURM_PROCID)"
    (cd "${repo}" && "${python}" -m megatron_hetermoe.tools.slurm --tasks --repo "${repo}" "${args[@]}")
    exit 0
fi
if ! command -v sbatch > /dev/null; then
    echo "launch.sh: sbatch not found: run this on a SLURM login node (or use --dry-run)" >&2
    exit 1
fi
sbatch "${script}"
