#!/usr/bin/env bash
# One node of an elastic HeterMoE SLURM job (launch.sh --elastic MIN_NODES; the srun line of its batch
# script runs one task per node): torchrun's elastic agent with every GPU of this node, rendezvous
# (c10d) on MASTER_ADDR:MASTER_PORT, at least MIN and at most the allocated nodes (HETERMOE_NNODES),
# restarting the workers up to HETERMOE_MAX_RESTARTS times. Arguments: the interpreter, then what
# it runs (-m megatron_hetermoe.training.pretrain_gpt <flags> --hetero-plan auto).
set -euo pipefail
python="${1:?agent.sh PYTHON -m MODULE FLAGS...}"
shift
: "${HETERMOE_NNODES:?set by the batch script}" "${HETERMOE_MAX_RESTARTS:?set by the batch script}"
: "${MASTER_ADDR:?set by the batch script}" "${MASTER_PORT:?set by the batch script}"
# HETERMOE_RDZV_CONF: torchrun's --rdzv-conf, where the site needs one (e.g. join_timeout=900).
rdzv_conf=()
if [[ -n "${HETERMOE_RDZV_CONF:-}" ]]; then
    rdzv_conf=(--rdzv-conf "${HETERMOE_RDZV_CONF}")
fi
# A node that comes back joins a later rendezvous round; with the agents' shared store (torch's default)
# it waits for a MASTER_ADDR the first round's rank 0 never publishes again (seen with torch 2.13), so
# each round gets its own store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# SLURM_GPUS_ON_NODE: this node's GPUs (the batch script asks --gpus-per-node per GPU type).
gpus="${HETERMOE_GPUS_ON_NODE:-${SLURM_GPUS_ON_NODE:?agent.sh runs under srun with --gpus-per-node}}"
exec "${python}" -m torch.distributed.run --nnodes "${HETERMOE_NNODES}" --nproc-per-node "${gpus}" \
    --max-restarts "${HETERMOE_MAX_RESTARTS}" --rdzv-backend c10d \
    --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "${SLURM_JOB_ID:-hetermoe}" "${rdzv_conf[@]}" "$@"
