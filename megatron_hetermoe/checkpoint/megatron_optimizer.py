"""Megatron's optimizer in Megatron's own (dist_checkpointing) checkpoints, on HeterMoE ranks.

dist_checkpointing writes what is not sharded (an optimizer's param_groups and common step) once,
from global rank 0, and gives it to every rank on load, so every rank must hold the same optimizer
structure. Megatron EP ranks do; HeterMoE ranks do not: an attention rank's optimizer holds dense
parameters (and offloaded experts under Asym-EA), an expert rank's holds experts only, so their
param_groups differ in number. `per_rank_optimizer_state` keeps Megatron's sharded optimizer state
as it is (Adam's moments under their layout-free keys, `optimizer.state.exp_avg.<param>`) and moves
the rest, with its structure, into one ShardedObject shard per rank. Resuming with the same plan
restores everything; loading into another layout needs --no-load-optim (as the structure differs).

The distributed optimizer's state is sharded over its data-parallel group and saved under keys
that name the group: `optimizer.distributed.dp_group_idx_<i>.*` (its param_groups and bucket
sizes, written by the group's first rank; its Adam buckets, a slice per rank), behind a
`chained_<k>.` prefix when the rank's ChainedOptimizer holds several. Megatron takes <i> from the
rank's position in its model-parallel group, which is one per data-parallel group only on
Megatron's grid, and <k> from the rank's chain, the same on every Megatron EP rank (dense, then
experts). Neither holds on HeterMoE ranks: an expert rank's model-parallel group is the rank
alone, so every stage's expert replicas (and attention ranks) get index 0, and attention ranks of
one data-parallel group hold one optimizer or two as Asym-EA gives them experts or not, which
moves their dense state between `chained_0.` and no prefix. `dp_group_index` names each group by
its members instead, and the chain prefix is dropped (the index says dense or experts).
"""
from __future__ import annotations

from megatron_hetermoe.shims import megatron_optimizer as shim

_MARK = "__hetero_sharded_leaf__"


def _flatten(x, path: str, flat: dict):
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedBase,
    )

    if isinstance(x, (ShardedBase, LocalNonpersistentObject)):
        flat[path] = x
        return (_MARK, path)
    if isinstance(x, dict):
        return {k: _flatten(v, f"{path}/{k}", flat) for k, v in x.items()}
    if isinstance(x, list):
        return [_flatten(v, f"{path}/{i}", flat) for i, v in enumerate(x)]
    return x


def _fill(x, flat: dict):
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _MARK:
        return flat[x[1]]
    if isinstance(x, dict):
        return {k: _fill(v, flat) for k, v in x.items()}
    if isinstance(x, list):
        return [_fill(v, flat) for v in x]
    return x


def dp_group_index(group_ranks: list[int], experts: bool, world_size: int) -> int:
    """A distributed optimizer's data-parallel group index, unique in the job: the group's lowest
    global rank, plus world_size for an expert optimizer. A rank is in one dense and one expert
    data-parallel group, so groups of one kind never share their lowest rank; the offset keeps a
    dense group apart from the expert group of the same ranks (attention ranks holding experts)."""
    return min(group_ranks) + (world_size if experts else 0)


def name_dp_groups(optimizer, world_size: int) -> None:
    """Set each DistributedOptimizer of `optimizer` (a ChainedOptimizer or one optimizer) to its
    dp_group_index; a rank with two of one kind over one group is refused (Megatron builds two
    dense ones only with --overlap-param-gather-with-optimizer-step, which it refuses with
    distributed checkpoints)."""
    import torch.distributed as dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    seen: dict[int, int] = {}
    for k, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        if not isinstance(opt, DistributedOptimizer):
            continue
        experts = any(g.get("is_expert_parallel", False) for g in opt.optimizer.param_groups)
        idx = dp_group_index(dist.get_process_group_ranks(opt.data_parallel_group), experts, world_size)
        if idx in seen:
            raise NotImplementedError(
                f"sub-optimizers {seen[idx]} and {k} of this rank are both {'expert' if experts else 'dense'} "
                f"distributed optimizers over one data-parallel group: their checkpoint keys would collide; "
                f"drop --overlap-param-gather-with-optimizer-step")
        seen[idx] = k
        opt.data_parallel_group_idx = idx


def _drop_chain_prefixes(state, optimizer) -> None:
    """Remove the `chained_<k>.` prefix ChainedOptimizer.sharded_state_dict put on sub-optimizer
    k's keys (module docstring): a rank's chain differs from its data-parallel peers'."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    subs = getattr(optimizer, "chained_optimizers", None)
    if not subs or len(subs) == 1:
        return  # Megatron prefixes nothing then
    for k, sub_state in state.items():
        prefix = f"chained_{k}."

        def strip(t, prefix=prefix):
            if isinstance(t, ShardedBase) and t.key.startswith(prefix):
                t.key = t.key[len(prefix):]
            return t

        dict_list_map_inplace(strip, sub_state)


def own_step_tensors(torch_optimizer) -> None:
    """Give each parameter's Adam state its own `step` tensor. megatron-core's DistributedOptimizer
    on torch's Adam (no apex, no transformer-engine) loads one `step` tensor into every
    parameter's state, and torch's Adam, which counts in place, then adds 1 to it once per
    parameter each step: the bias correction after a resume would use a wrong step."""
    import torch

    for st in torch_optimizer.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].clone()


def per_rank_optimizer_state(optimizer, rank: int, world_size: int) -> None:
    """Wrap `optimizer`'s sharded_state_dict / load_state_dict (the pair Megatron-LM's checkpointing
    calls) so its non-sharded state is one shard of this rank and its distributed optimizers'
    data-parallel state is keyed by group (module docstring)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    name_dp_groups(optimizer, world_size)
    save, load = optimizer.sharded_state_dict, optimizer.load_state_dict

    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
        flat: dict = {}
        state = save(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)
        _drop_chain_prefixes(state, optimizer)
        skeleton = _flatten(state, "", flat)
        return {"sharded": flat, "structure": ShardedObject("optimizer.hetero_per_rank_structure", skeleton,
                                                             (world_size,), (rank,), replica_id=0)}

    def load_state_dict(state_dict: dict):
        return load(_fill(state_dict["structure"], state_dict["sharded"]))

    shim.replace_state_dict_io(optimizer, sharded_state_dict, load_state_dict)
