"""A canonical full tensor <-> one tensor-parallel rank's shard of it, as megatron-core splits
parameters under TP (expert TP stays 1: experts are never split here).

Megatron marks a TP-sharded parameter with `tensor_model_parallel=True`, `partition_dim` and
`partition_stride`; the canonical tensor is the TP=1 parameter (models/builder.canonical_names).
Three kinds of split (`ShardSpec.kind`):

    "chunk"  a contiguous chunk along partition_dim: linear_qkv (dim 0, whole query groups),
             linear_proj / linear_fc2 (dim 1), word embeddings and the output layer (dim 0, vocab)
    "glu"    a gated linear unit's fc1 (SwiGLU): the full weight is [gate; up] (dim 0), TP rank i
             holds [gate_i; up_i] (megatron's MLP chunks its local output into gate and up)
    None     not split (replicated on every TP rank): norms, routers, biases of row-parallel
             layers, and every expert parameter (`allreduce == False`)
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

KINDS = ("chunk", "glu")


class ShardSpec(NamedTuple):
    """How one TP rank's parameter relates to its canonical full tensor (kind None: it is it)."""

    kind: str | None
    dim: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def split(self) -> bool:
        return self.kind is not None and self.tp_size > 1


REPLICATED = ShardSpec(None)


def shard_spec(param: torch.nn.Parameter, name: str, tp_rank: int, tp_size: int, glu: bool = True) -> ShardSpec:
    """The split of `param` (local or canonical `name`) on TP rank `tp_rank` of `tp_size`; `glu`:
    the model's MLPs are gated (config.gated_linear_unit: fc1 is [gate; up])."""
    if tp_size <= 1 or not getattr(param, "tensor_model_parallel", False):
        return REPLICATED
    if getattr(param, "allreduce", True) is False:  # expert parameters: expert TP is 1 here
        return REPLICATED
    dim = int(getattr(param, "partition_dim", 0))
    kind = "glu" if glu and dim == 0 and name.endswith("linear_fc1.weight") else "chunk"
    stride = getattr(param, "partition_stride", 1)
    # megatron-core 0.16+ marks a gated fc1 (dense MLPs, shared experts) stride 2: [gate_i; up_i]
    # on rank i, which is the "glu" split itself.
    if stride != 1 and not (stride == 2 and kind == "glu"):
        raise ValueError(f"{name}: partition_stride {stride} is not handled (only 1, or 2 on a gated fc1)")
    return ShardSpec(kind, dim, tp_rank, tp_size)


def shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of the canonical `full` tensor (a view where possible)."""
    if not spec.split:
        return full
    n = spec.tp_size
    if full.shape[spec.dim] % (2 * n if spec.kind == "glu" else n):
        raise ValueError(f"dim {spec.dim} of size {full.shape[spec.dim]} does not split into {n} TP shards"
                         f"{' of [gate; up]' if spec.kind == 'glu' else ''}")
    if spec.kind == "glu":
        gate, up = full.chunk(2, dim=spec.dim)
        return torch.cat([gate.chunk(n, dim=spec.dim)[spec.tp_rank], up.chunk(n, dim=spec.dim)[spec.tp_rank]],
                         dim=spec.dim)
    if spec.kind == "chunk":
        return full.chunk(n, dim=spec.dim)[spec.tp_rank]
    raise ValueError(f"shard kind {spec.kind!r} is unknown; use one of {list(KINDS)}")


def merge(shards: Mapping[int, torch.Tensor] | list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The canonical full tensor from every TP rank's shard (`shards[i]`: rank i's; spec: any
    rank's, its tp_rank is ignored)."""
    parts = [shards[i] for i in range(spec.tp_size)] if spec.split else [shards[0]]
    if not spec.split:
        return parts[0]
    if spec.kind == "glu":
        halves = [p.chunk(2, dim=spec.dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=spec.dim)
    if spec.kind == "chunk":
        return torch.cat(parts, dim=spec.dim)
    raise ValueError(f"shard kind {spec.kind!r} is unknown; use one of {list(KINDS)}")


def full_shape(shape: torch.Size, spec: ShardSpec) -> torch.Size:
    """The canonical tensor's shape from a shard's."""
    if not spec.split:
        return torch.Size(shape)
    s = list(shape)
    s[spec.dim] *= spec.tp_size
    return torch.Size(s)


def tp_coords(tp_group) -> tuple[int, int]:
    """(this rank's TP rank, TP size) in `tp_group` (None: (0, 1))."""
    if tp_group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def module_specs(module: torch.nn.Module, tp_group, glu: bool = True) -> dict[str, ShardSpec]:
    """local parameter name -> ShardSpec for every parameter of `module` on this TP rank."""
    rank, size = tp_coords(tp_group)
    return {n: shard_spec(p, n, rank, size, glu) for n, p in module.named_parameters()}


def gathered(t: torch.Tensor, spec: ShardSpec, tp_group) -> torch.Tensor:
    """The canonical full tensor of this rank's shard `t` (of a parameter or its gradient), from
    every TP rank's shard over `tp_group` (collective: every TP rank calls it for the same
    parameters in the same order); `t` itself when the parameter is not split."""
    if not spec.split:
        return t
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(spec.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return merge(parts, spec)


def shard_local_state(module: torch.nn.Module, local_state: Mapping[str, torch.Tensor], tp_group,
                      glu: bool = True) -> dict[str, torch.Tensor]:
    """A module's local state whose TP-split parameters hold canonical full tensors (what
    plan/expert_names.module_state gives from a canonical state) cut to this rank's shards, for
    plan/layout.load_params. Entries already of the shard's shape, or not split, pass as they are."""
    specs = module_specs(module, tp_group, glu)
    params = dict(module.named_parameters())
    out = dict(local_state)
    for n, t in local_state.items():
        spec = specs.get(n)
        if spec is not None and spec.split and t.shape == full_shape(params[n].shape, spec):
            out[n] = shard(t, spec)
    return out
