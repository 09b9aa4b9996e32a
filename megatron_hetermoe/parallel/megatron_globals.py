"""The few megatron-core globals that have no explicit-process-group path, set for a HeterMoE
rank: the global memory buffer, the RNG tracker, and the tensor-parallel group that
vocab-parallel cross-entropy reads. Everything else gets HeteroParallelState's groups."""
from __future__ import annotations

from contextlib import contextmanager

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
