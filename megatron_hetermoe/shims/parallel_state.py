"""megatron-core's parallel_state globals (megatron.core.parallel_state), for the code that still
reads them: the plugin trainer's few reads without an explicit-group path, and Megatron-LM's
pretrain(), which reads them throughout. The parallel layer decides which of the plan's groups
serves which global (parallel/megatron_globals.py, from layout.MEGATRON_DIMS); these functions
write them, and undo that."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Mapping

from megatron_hetermoe.shims._replace import replaced


@contextlib.contextmanager
def tensor_parallel_group(group) -> Iterator[None]:
    """For the block: megatron-core's global memory buffer, and its tensor-parallel group global
    set to `group`. Why: vocab-parallel cross-entropy and the global memory buffer have no
    explicit-process-group path in megatron-core 0.16.1 .. 0.19 (everything else gets the
    plan's groups explicitly)."""
    from megatron.core import parallel_state as ps

    ps._set_global_memory_buffer()
    try:
        with replaced([(ps, "_TENSOR_MODEL_PARALLEL_GROUP", group)]):
            yield
    finally:
        ps.destroy_global_memory_buffer()


@contextlib.contextmanager
def tensor_and_data_parallel_group(group) -> Iterator[None]:
    """For the block, megatron-core's tensor x data x context parallel group global set to `group`.
    Why: megatron-core 0.16.1 .. 0.19's get_updated_expert_bias (the aux-loss-free expert bias
    update, from finalize_model_grads) all-reduces the routers' token counts over that global and
    has no explicit-process-group path."""
    from megatron.core import parallel_state as ps

    with replaced([(ps, "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", group)]):
        yield


def install(values: Mapping[str, object]) -> None:
    """Set each parallel_state global named in `values` (groups, rank lists, sizes) and the global
    memory buffer, for Megatron-LM's pretrain(). Refuses when megatron-core's own model parallel
    state exists: the plan sets it, nothing may have initialized it before."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core's model parallel state is already initialized; HeterMoE sets it from "
                           "the plan, so nothing may call initialize_model_parallel before it")
    for name, value in values.items():
        setattr(ps, name, value)
    ps._set_global_memory_buffer()


def uninstall(names: Iterable[str]) -> None:
    """Unset the globals `install` set (and the global memory buffer)."""
    from megatron.core import parallel_state as ps

    for name in names:
        setattr(ps, name, None)
    ps.destroy_global_memory_buffer()


@contextlib.contextmanager
def initialize_model_parallel_replaced(setup: Callable[[], None]) -> Iterator[None]:
    """For the block, megatron-core's initialize_model_parallel calls `setup()` (whatever its
    arguments) instead: Megatron-LM's _initialize_distributed then builds the plan's groups."""
    from megatron.core import parallel_state as ps

    with replaced([(ps, "initialize_model_parallel", lambda *x, **y: setup())]):
        yield


# core_v0.19.0's parallel_state: the data-parallel groups "with GTP_remat" (GTP weight
# rematerialization, an axis over DP) are its defaults (ProcessGroupCollection.use_mpu_process_groups,
# which its pretrain() calls, reads them), and the optimizer's setup reads the expert
# tensor-model-pipeline group "with EGTP". Without GTP_remat (size 1) each is the group without it.
_GTP_REMAT_ALIASES = {
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_EXPERT_DATA_PARALLEL_GROUP",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
}


def alias_gtp_remat_groups() -> None:
    """After install: core_v0.19.0's "with GTP_remat" data-parallel groups are the plan's groups
    without it (a release without them, core_v0.16.1: nothing to do)."""
    from megatron.core import parallel_state as ps

    for name, base in _GTP_REMAT_ALIASES.items():
        if hasattr(ps, name):
            setattr(ps, name, getattr(ps, base))


def unalias_gtp_remat_groups() -> None:
    from megatron.core import parallel_state as ps

    for name in _GTP_REMAT_ALIASES:
        if hasattr(ps, name):
            setattr(ps, name, None)
