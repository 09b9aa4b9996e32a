"""Megatron's optimizer in Megatron's own (dist_checkpointing) checkpoints, on HeterMoE ranks.

dist_checkpointing writes what is not sharded (an optimizer's param_groups and common step) once,
from global rank 0, and gives it to every rank on load, so every rank must hold the same optimizer
structure. Megatron EP ranks do; HeterMoE ranks do not: an attention rank's optimizer holds dense
parameters (and offloaded experts under Asym-EA), an expert rank's holds experts only, so their
param_groups differ in number. `per_rank_optimizer_state` keeps Megatron's sharded optimizer state
as it is (Adam's moments under their layout-free keys, `optimizer.state.exp_avg.<param>`) and moves
the rest, with its structure, into one ShardedObject shard per rank. Resuming with the same plan
restores everything; loading into another layout needs --no-load-optim (as the structure differs).
"""
from __future__ import annotations

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


def per_rank_optimizer_state(optimizer, rank: int, world_size: int) -> None:
    """Wrap `optimizer`'s sharded_state_dict / load_state_dict (the pair Megatron-LM's checkpointing
    calls) so its non-sharded state is one shard of this rank (module docstring)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    save, load = optimizer.sharded_state_dict, optimizer.load_state_dict

    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
        flat: dict = {}
        skeleton = _flatten(save(model_sharded_state_dict, is_loading=is_loading, metadata=metadata), "", flat)
        return {"sharded": flat, "structure": ShardedObject("optimizer.hetero_per_rank_structure", skeleton,
                                                             (world_size,), (rank,), replica_id=0)}

    def load_state_dict(state_dict: dict):
        return load(_fill(state_dict["structure"], state_dict["sharded"]))

    optimizer.sharded_state_dict = sharded_state_dict
    optimizer.load_state_dict = load_state_dict
