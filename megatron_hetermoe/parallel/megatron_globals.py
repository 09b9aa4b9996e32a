"""megatron-core's globals on a HeterMoE rank: which of the plan's groups serves which
parallel_state global (shims/parallel_state.py writes them).

`megatron_globals`: for the plugin's own trainer, the few globals that have no explicit-process-group
path (the global memory buffer, the RNG tracker, the tensor-parallel group that vocab-parallel
cross-entropy reads, the tensor x data group the expert bias update reads); everything else gets
HeteroParallelState's groups explicitly.
`install_parallel_state`: for Megatron-LM's own pretrain(), which reads parallel_state throughout,
every group global set to the rank's HeterMoE group (megatron_lm/hooks.py).
"""
from __future__ import annotations

from contextlib import contextmanager

from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.shims import parallel_state
from megatron_hetermoe.vocabulary import Role


@contextmanager
def megatron_globals(hs: HeteroParallelState, seed: int):
    from megatron.core.tensor_parallel import random as mrandom

    # The routers live on attention ranks: their aux-loss-free bias update sums the token counts over
    # every attention rank of the stage (Megatron's tp x dp x cp), so every replica's bias stays the
    # same. Expert ranks have no router: the global stays unset there, a read of it fails loudly.
    tp_dp = hs.megatron_group("tp_dp_cp") if hs.role == Role.ATTENTION else None
    with parallel_state.tensor_parallel_group(hs.megatron_group("tp")), \
            parallel_state.tensor_and_data_parallel_group(tp_dp):
        mrandom.initialize_rng_tracker(force_reset=True)
        # Megatron seeds the tensor-parallel RNG stream by TP rank (dropout inside TP regions differs per shard).
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=hs.tp_rank, ep_rank=0, etp_rank=0,
                                                force_reset_rng=True)
        yield


# megatron-core parallel_state globals -> the megatron-core dimension each one is
# (parallel/layout.py MEGATRON_DIMS maps a dimension to the group kind serving it on a rank of
# each role, as HeteroParallelState.pg_collection() hands them to modules).
_PARALLEL_STATE_GROUPS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp", "_PIPELINE_MODEL_PARALLEL_GROUP": "pp", "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd", "_POSITION_EMBEDDING_GROUP": "pos_embd", "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp", "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter_partial_expt_dp",
    "_DATA_PARALLEL_GROUP": "dp", "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp", "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra_expt_dp",
}
_PARALLEL_STATE_RANKS = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp", "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp", "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
}


def parallel_state_globals(hs: HeteroParallelState) -> dict[str, object]:
    """megatron-core's parallel_state globals -> this rank's value, for Megatron-LM's training loop
    (which reads the globals), from the same table as hs.pg_collection() (layout.MEGATRON_DIMS),
    so `ProcessGroupCollection.use_mpu_process_groups()` equals it. Gloo twins, hierarchical CP
    and the inter-instance distributed-optimizer groups stay unset: a read of one fails in
    megatron-core instead of using a wrong group."""
    values: dict[str, object] = {name: hs.megatron_group(dim) for name, dim in _PARALLEL_STATE_GROUPS.items()}
    values.update({name: hs.layout.ranks(hs.layout.megatron_kind(dim)) for name, dim in _PARALLEL_STATE_RANKS.items()})
    # How many data-parallel ranks the job has is a question about the data (Megatron-LM counts
    # consumed samples, hence batch-size ramp-up and sample-based schedules, and sizes its data
    # samplers by it): the attention members, which consume distinct data, on every rank. An expert
    # rank's data-parallel group stays its replica group (gradients are reduced over that).
    values["_MPU_DATA_PARALLEL_WORLD_SIZE"] = hs.plan.num_attention_members
    # Virtual pipeline stages are the attention ranks' (Megatron-LM's get_model builds a model
    # chunk per virtual stage there); an expert rank, outside Megatron's pipeline, builds one module.
    V = hs.plan.virtual_stages
    values["_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"] = V if V > 1 and hs.role == Role.ATTENTION else None
    return values


def install_parallel_state(hs: HeteroParallelState) -> None:
    """Make megatron-core's parallel_state name this rank's HeterMoE groups (parallel_state_globals)."""
    parallel_state.install(parallel_state_globals(hs))


def uninstall_parallel_state() -> None:
    parallel_state.uninstall((*_PARALLEL_STATE_GROUPS, *_PARALLEL_STATE_RANKS, "_MPU_DATA_PARALLEL_WORLD_SIZE",
                              "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"))
