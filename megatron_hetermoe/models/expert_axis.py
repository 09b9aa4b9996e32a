"""Megatron's checkpoint layout of an experts module, renumbered to the plan's expert ids.

megatron-core's expert modules (SequentialMLP, TEGroupedMLP, GroupedMLP) all write the same
global tensors (`...mlp.experts.experts.linear_fc1.weight` with an expert axis, GLU halves as
w/v shards), but each numbers its local experts contiguously: local expert i is global expert
ep_rank * n + i. HeterMoE's plan places experts anywhere (Asym-EA, uneven counts), so a holder's
local expert i is global expert ids[i]. `plan_sharded_state_dict` takes the module's own sharded
state dict, whatever the module, and moves every shard to its expert's place on the expert axis
(or, with singleton_local_shards, into its expert's key), so a HeterMoE checkpoint and a Megatron
EP one name every expert alike whichever kernels wrote them.

GroupedMLP writes all its local experts as one shard whose first data axis is the expert axis;
experts that are not contiguous on the global axis cannot be one shard, so that shard is cut
into one shard per expert, in the form SequentialMLP writes (expert axis prepended, [out, in]
data), and joined back for the module's own merge on load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch


class ExpertAxisError(ValueError):
    """A shard that does not sit where megatron-core's numbering puts a local expert."""


@dataclass(frozen=True)
class ExpertAxis:
    """Where megatron-core put this holder's experts, and where the plan puts them."""

    axis: int  # the expert axis: len(sharded_offsets) the module was called with
    first: int  # megatron-core's global index of local expert 0 (ep_rank * n)
    ids: tuple[int, ...]  # the plan's global id of each local expert
    num_experts: int  # E, the expert axis' global size
    prefix: str  # `...mlp.experts.`: singleton keys are `{prefix}experts.{id}.`
    replica_rank: int  # this holder's index among the holders of the same experts (ZP groups)

    def plan_id(self, megatron_index: int) -> int:
        i = megatron_index - self.first
        if not 0 <= i < len(self.ids):
            raise ExpertAxisError(f"a shard at expert index {megatron_index} is not one of this module's "
                                  f"{len(self.ids)} local experts (megatron numbers them from {self.first})")
        return self.ids[i]

    def replica(self, replica_id: Any) -> Any:
        # (PP, TP, DP) -> the DP part is replication across ZP groups only.
        return (*replica_id[:2], self.replica_rank) if isinstance(replica_id, tuple) else replica_id

    def key(self, key: str) -> str:
        """A singleton_local_shards key `{prefix}experts.{megatron index}.` -> the plan's id."""
        head = f"{self.prefix}experts."
        if not key.startswith(head):
            return key
        m = re.match(r"(\d+)\.", key[len(head):])
        if m is None:
            return key
        return f"{head}{self.plan_id(int(m.group(1)))}.{key[len(head) + m.end():]}"


def _with_expert(sh, ax: ExpertAxis, gid: int, *, data=None, prepend: int | None = None):
    """`sh` at global expert `gid` on an expert axis of size E (axis_fragmentations as
    ShardedTensor.from_rank_offsets computes them: global // local, 1-wide prepended axes)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = list(sh.global_shape)
    offset = list(sh.global_offset)
    shape[ax.axis], offset[ax.axis] = ax.num_experts, gid
    if not isinstance(sh, ShardedTensor):  # ShardedObject: the offsets are all it has
        return replace(sh, global_shape=tuple(shape), global_offset=tuple(offset), replica_id=ax.replica(sh.replica_id))
    data = sh.data if data is None else data
    prepend = sh.prepend_axis_num if prepend is None else prepend
    local = tuple(data.shape)
    frags = tuple(shape[i] if i < prepend else shape[i] // local[i - prepend] for i in range(len(shape)))
    return replace(sh, data=data, local_shape=local, global_shape=tuple(shape), global_offset=tuple(offset),
                   axis_fragmentations=frags, prepend_axis_num=prepend, replica_id=ax.replica(sh.replica_id))


def _remap_leaf(sh, ax: ExpertAxis, singleton: bool):
    """One ShardedTensor/ShardedObject -> (the remapped shard, or a list of per-expert shards; how
    many experts were cut out of a data axis, None when none were)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if not isinstance(sh, (ShardedTensor, ShardedObject)):
        return sh, None
    if singleton:  # no expert axis: the expert is in the key
        return replace(sh, key=ax.key(sh.key), replica_id=ax.replica(sh.replica_id)), None
    if len(sh.global_shape) <= ax.axis:
        raise ExpertAxisError(f"{sh.key}: {len(sh.global_shape)} axes, no expert axis {ax.axis}")
    start = sh.global_offset[ax.axis]
    if isinstance(sh, ShardedObject) or ax.axis < sh.prepend_axis_num:
        return _with_expert(sh, ax, ax.plan_id(start)), None
    if ax.axis != sh.prepend_axis_num:
        raise ExpertAxisError(f"{sh.key}: expert axis {ax.axis} is neither prepended nor the first data axis")
    if sh.flattened_range is not None:
        raise ExpertAxisError(f"{sh.key}: a flattened slice across {sh.local_shape[0]} experts cannot be placed "
                              f"expert by expert (megatron-core's GroupedMLP has no flattened form either)")
    pieces = [_with_expert(sh, ax, ax.plan_id(start + j), data=sh.data.select(0, j), prepend=sh.prepend_axis_num + 1)
              for j in range(sh.data.shape[0])]
    return pieces, len(pieces)


def _remap_tree(x, ax: ExpertAxis, singleton: bool):
    """(x with every shard remapped, the same tree with the cut counts at the leaves)."""
    if isinstance(x, dict):
        pairs = {k: _remap_tree(v, ax, singleton) for k, v in x.items()}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
    if isinstance(x, list):
        pairs = [_remap_tree(v, ax, singleton) for v in x]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return _remap_leaf(x, ax, singleton)


def _join_tree(loaded, cuts):
    """The inverse of the cuts: per-expert tensors stacked back on the first data axis."""
    if isinstance(cuts, dict):
        return {k: _join_tree(loaded[k], c) for k, c in cuts.items()}
    if isinstance(cuts, list):
        return [_join_tree(v, c) for v, c in zip(loaded, cuts)]
    if cuts is None:
        return loaded
    if len(loaded) != cuts:
        raise ExpertAxisError(f"loaded {len(loaded)} expert pieces where {cuts} were cut")
    return torch.stack(list(loaded))


def _any_cut(cuts) -> bool:
    if isinstance(cuts, dict):
        return any(_any_cut(c) for c in cuts.values())
    if isinstance(cuts, list):
        return any(_any_cut(c) for c in cuts)
    return cuts is not None


def _remap_factory(fac, ax: ExpertAxis, singleton: bool):
    """A ShardedTensorFactory whose built shards are remapped and whose merge first joins them."""
    build, merge = fac.build_fn, fac.merge_fn
    cuts: dict[str, Any] = {}  # the structure of the last build (the same for every build of this factory)

    def build_fn(key, data, replica_id, flattened_range):
        tree, cuts["tree"] = _remap_tree(build(key, data, replica_id, flattened_range), ax, singleton)
        return tree

    def merge_fn(sub_state_dict):
        return merge(_join_tree(sub_state_dict, cuts["tree"]))

    return replace(fac, build_fn=build_fn, merge_fn=merge_fn, replica_id=ax.replica(fac.replica_id))


def plan_sharded_state_dict(experts, global_ids: Sequence[int], num_experts: int, replica_rank: int,
                            prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
    """`experts.sharded_state_dict(prefix, sharded_offsets, metadata)` (megatron-core's own, any
    expert module) with local expert i at global expert global_ids[i]. `replica_rank`: this holder's
    index among the replicas of these experts (ZP groups)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    n = int(getattr(experts, "num_local_experts", len(global_ids)))
    if n != len(global_ids):
        raise ExpertAxisError(f"{type(experts).__name__} holds {n} experts but the plan gives it {list(global_ids)}")
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = bool((metadata or {}).get("singleton_local_shards", False))
    ep = getattr(experts, "ep_group", None)
    first = (ep.rank() if ep is not None else 0) * n
    ax = ExpertAxis(len(sharded_offsets), first, tuple(int(i) for i in global_ids), num_experts, prefix, replica_rank)
    out = {}
    for k, v in experts.sharded_state_dict(prefix, sharded_offsets, metadata).items():
        if isinstance(v, ShardedTensorFactory):
            out[k] = _remap_factory(v, ax, singleton)
        else:
            tree, cuts = _remap_tree(v, ax, singleton)
            if _any_cut(cuts):  # a shard over several experts that no merge joins back: megatron-core writes none
                raise ExpertAxisError(f"{k}: a shard holds several experts outside a factory; cannot renumber it")
            out[k] = tree
    return out
