"""megatron-core's globals on a HeterMoE rank.

`megatron_globals`: for the plugin's own trainer, the few globals that have no explicit-process-group
path (the global memory buffer, the RNG tracker, the tensor-parallel group that vocab-parallel
cross-entropy reads); everything else gets HeteroParallelState's groups explicitly.
`install_parallel_state`: for Megatron-LM's own pretrain(), which reads parallel_state throughout,
every group global set to the rank's HeterMoE group (training/megatron_lm_hooks.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from megatron_hetermoe.parallel.state import HeteroParallelState


@contextmanager
def megatron_globals(hs: HeteroParallelState, seed: int):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    ps._set_global_memory_buffer()
    ps._TENSOR_MODEL_PARALLEL_GROUP = hs.self_group
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    try:
        yield
    finally:
        ps._TENSOR_MODEL_PARALLEL_GROUP = None
        ps.destroy_global_memory_buffer()


# megatron-core parallel_state globals -> the HeterMoE group each one is on this rank, as
# HeteroParallelState.pg_collection() hands them to modules ("one": this rank alone; "dp": the
# attention DP group on attention ranks, the expert replica group on expert ranks).
_PARALLEL_STATE_GROUPS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "one", "_PIPELINE_MODEL_PARALLEL_GROUP": "one",
    "_MODEL_PARALLEL_GROUP": "one", "_EMBEDDING_GROUP": "one", "_POSITION_EMBEDDING_GROUP": "one",
    "_CONTEXT_PARALLEL_GROUP": "one", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "one",
    "_EXPERT_MODEL_PARALLEL_GROUP": "one", "_EXPERT_TENSOR_PARALLEL_GROUP": "one",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "one", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "one",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "one",
    "_DATA_PARALLEL_GROUP": "dp", "_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp", "_TENSOR_AND_DATA_PARALLEL_GROUP": "dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "dp", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "dp",
    "_EXPERT_DATA_PARALLEL_GROUP": "replica", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "replica",
}
_PARALLEL_STATE_RANKS = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "one", "_PIPELINE_GLOBAL_RANKS": "one",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "one", "_EMBEDDING_GLOBAL_RANKS": "one",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "one", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "one",
    "_EXPERT_MODEL_PARALLEL_RANKS": "one",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp",
}


def install_parallel_state(hs: HeteroParallelState) -> None:
    """Make megatron-core's parallel_state name this rank's HeterMoE groups, for Megatron-LM's
    training loop (which reads the globals): every model-parallel dimension is the rank alone,
    data parallelism is the attention DP group (attention ranks) or the expert replica group
    (expert ranks), so `ProcessGroupCollection.use_mpu_process_groups()` equals
    `hs.pg_collection()`. Gloo twins, hierarchical CP and the inter-instance distributed-optimizer
    groups stay unset: a read of one fails in megatron-core instead of using a wrong group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core's model parallel state is already initialized; HeterMoE sets it from "
                           "the plan, so nothing may call initialize_model_parallel before it")
    dp = hs.attention_dp_group if hs.role == "attention" else hs.replica_group
    groups = {"one": hs.self_group, "dp": dp, "replica": hs.replica_group}
    ranks = {"one": [hs.rank], "dp": dist.get_process_group_ranks(dp)}
    for name, which in _PARALLEL_STATE_GROUPS.items():
        setattr(ps, name, groups[which])
    for name, which in _PARALLEL_STATE_RANKS.items():
        setattr(ps, name, list(ranks[which]))
    # How many data-parallel ranks the job has is a question about the data (Megatron-LM counts
    # consumed samples, hence batch-size ramp-up and sample-based schedules, and sizes its data
    # samplers by it): the attention ranks, which consume distinct data, on every rank. An expert
    # rank's data-parallel group stays its replica group (gradients are reduced over that).
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = len(hs.plan.attention_ranks)
    ps._set_global_memory_buffer()


def uninstall_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    for name in (*_PARALLEL_STATE_GROUPS, *_PARALLEL_STATE_RANKS, "_MPU_DATA_PARALLEL_WORLD_SIZE"):
        setattr(ps, name, None)
    ps.destroy_global_memory_buffer()
