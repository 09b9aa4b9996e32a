"""Megatron's optimizer in Megatron's own (dist_checkpointing) checkpoints, on HeterMoE ranks.

dist_checkpointing writes what is not sharded (an optimizer's param_groups and common step) once,
from global rank 0, and gives it to every rank on load, so every rank must hold the same optimizer
structure. Megatron EP ranks do; HeterMoE ranks do not: an attention rank's optimizer holds dense
parameters (and offloaded experts under Asym-EA), an expert rank's holds experts only, so their
param_groups differ in number. `per_rank_optimizer_state` keeps Megatron's sharded optimizer state
as it is (Adam's moments under their layout-free keys, `optimizer.state.exp_avg.<param>`) and moves
the rest, with its structure, into one ShardedObject shard per rank. Resuming with the same plan
restores everything; loading into another plan (`reshard`) keeps the rank's own structure and loads
the rest by parameter name, with the step and loss scaler from one object every layout can read.

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


_COMMON_KEYS = ("common_step", "grad_scaler")


def _dicts(x):
    """Every dict in a nested dict/list structure, outermost first."""
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _dicts(v)
    elif isinstance(x, list):
        for v in x:
            yield from _dicts(v)


def _param_groups(d: dict) -> list:
    groups = d.get("param_groups")
    return [g for g in groups if isinstance(g, dict) and "step" in g] if isinstance(groups, list) else []


def _common_state(skeleton) -> dict:
    """What every rank's optimizer holds alike, found in a rank's skeleton: Adam's step (megatron-core
    keeps one step for all parameters: `state.common_step`, or on torch's Adam under the distributed
    optimizer each param group's `step`) and the loss scaler's state (one loss scale for the world).
    Only the first of each is kept: every rank steps and scales together."""
    found: dict = {}
    for d in _dicts(skeleton):
        for k in _COMMON_KEYS:
            if k in d:
                found.setdefault(k, d[k])
        for g in _param_groups(d):
            found.setdefault("param_group_step", g["step"])
    return found


def _put_common_state(skeleton, common: dict) -> None:
    """Write the saved step and loss scaler into this rank's own skeleton: the step into each torch
    optimizer's state (a dict with `state` and `param_groups`) or its param groups, the scaler
    wherever the skeleton has one."""
    for d in list(_dicts(skeleton)):
        if "state" in d and "param_groups" in d and common.get("common_step") is not None:
            d["state"]["common_step"] = common["common_step"]
        if "grad_scaler" in d and common.get("grad_scaler") is not None:
            d["grad_scaler"] = common["grad_scaler"]
        if common.get("param_group_step") is not None:
            for g in _param_groups(d):
                g["step"] = common["param_group_step"]


def per_rank_optimizer_state(optimizer, rank: int, world_size: int, reshard: bool = False) -> None:
    """Wrap `optimizer`'s sharded_state_dict / load_state_dict (the pair Megatron-LM's checkpointing
    calls) so its non-sharded state is one shard of this rank and its distributed optimizers'
    data-parallel state is keyed by group (module docstring).

    Every save also writes what all ranks hold alike (`_common_state`) once, as an object any rank
    of any layout can read. `reshard`: the checkpoint to load was saved on another plan, so this
    rank's shard of the non-sharded state is not there (or is another role's): the rank keeps its
    own optimizer's structure and hyperparameters (the LR schedule sets the rates), loads Adam's
    moments and fp32 main parameters by parameter name, and the step and loss scaler from that
    object. (The distributed optimizer's default format keys its state by group:
    megatron_lm/checkpoints.py refuses it across plans; its fully reshardable format loads.)"""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    name_dp_groups(optimizer, world_size)
    save, load = optimizer.sharded_state_dict, optimizer.load_state_dict

    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
        flat: dict = {}
        state = save(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)
        _drop_chain_prefixes(state, optimizer)
        skeleton = _flatten(state, "", flat)
        common = ShardedObject("optimizer.hetero_common", _common_state(skeleton), (1,), (0,), replica_id=rank)
        if is_loading and reshard:
            return {"sharded": flat, "common": common, "skeleton": LocalNonpersistentObject(skeleton)}
        out = {"sharded": flat, "structure": ShardedObject("optimizer.hetero_per_rank_structure", skeleton,
                                                            (world_size,), (rank,), replica_id=0)}
        if not is_loading:  # checkpoints saved before the common object existed still load
            out["common"] = common
        return out

    def load_state_dict(state_dict: dict):
        if "skeleton" in state_dict:
            skeleton = state_dict["skeleton"]
            _put_common_state(skeleton, state_dict["common"])
            return load(_fill(skeleton, state_dict["sharded"]))
        return load(_fill(state_dict["structure"], state_dict["sharded"]))

    shim.replace_state_dict_io(optimizer, sharded_state_dict, load_state_dict)
