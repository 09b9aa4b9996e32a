"""Megatron's model statistics over a HeterMoE world, each parameter counted once: the gradient norm
that clipping divides by, and the logged ones (--log-params-norm, --log-num-zeros-in-grad).

Megatron counts each parameter once by its groups: dense parameters over the model-parallel group,
expert parameters over the expert-model-parallel one. On a HeterMoE world the copies sit elsewhere:
every attention rank holds the dense parameters (data parallel), and the experts of a layer are
spread over the attention and expert ranks of each ZP group, one copy per group. A parameter
counts on its owner (RankLayout.owns_gradient: dense on attention DP rank 0, experts in ZP group
0), a distributed optimizer's shard on the rank that holds it; one sum over the world, so every
rank, the logging rank included, gets the one value.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_hetermoe.parallel.state import HeteroParallelState


def holds_experts(optimizer) -> bool:
    """Whether a Megatron sub-optimizer steps expert parameters: Megatron's factory keeps dense and
    expert parameters (allreduce=False) in separate sub-optimizers and marks each param group's
    is_expert_parallel (its main-parameter copies in 16-bit carry no allreduce attribute)."""
    expert = {bool(g.get("is_expert_parallel", False)) for g in optimizer.param_groups}
    if len(expert) > 1:
        raise RuntimeError("a Megatron sub-optimizer holds both dense and expert parameters; HeterMoE counts "
                           "each sub-optimizer's gradients in the global norm on one owner")
    return expert == {True}


def counts_here(optimizer, hs: HeteroParallelState) -> bool:
    """Whether this rank counts a sub-optimizer's gradients in a world statistic (the norm, the
    zeros): a distributed optimizer counts its own shard on every rank; otherwise the owner of its
    parameters' gradients does (RankLayout.owns_gradient: dense on attention DP rank 0, experts in
    ZP group 0)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer) or hs.owns_gradient(holds_experts(optimizer))


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)  # Megatron's mark of an expert parameter


def params_l2_norm(model_chunks: list, hs: HeteroParallelState, use_main_params: bool) -> float:
    """The L2 norm of the world's model, as Megatron's calc_params_l2_norm takes it: with
    `use_main_params` (bf16) of the fp32 main parameters where the optimizer keeps them (else an
    fp32 copy), of the parameters themselves otherwise."""
    squares = torch.zeros(1, dtype=torch.float32, device=hs.device)
    seen: set[int] = set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if id(p) in seen:  # a tied parameter once (Megatron: param_is_not_shared)
                continue
            seen.add(id(p))
            if use_main_params and hasattr(p, "main_param"):
                if getattr(p, "main_param_sharded", False):
                    data = p.main_param  # this rank's shard (None: it holds none of p)
                else:
                    data = p.main_param if hs.owns_gradient(_is_expert(p)) else None
            elif hs.owns_gradient(_is_expert(p)):
                data = p.data.float() if use_main_params else p.data
            else:
                data = None
            if data is not None:
                squares += data.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=hs.world_group)
    return squares.item() ** 0.5


def world_count_zeros(optimizer, hs: HeteroParallelState):
    """A replacement for `optimizer.count_zeros` (Megatron's, chained or not): the zeros in the
    gradients the world steps, each counted on its owner (a distributed optimizer's shards on every
    rank that holds one), summed over the world in one collective (every rank enters it once,
    whatever number of sub-optimizers it holds)."""
    from megatron.core.optimizer.clip_grads import count_zeros_fp32

    subs = getattr(optimizer, "chained_optimizers", [optimizer])

    def count_zeros() -> float:
        params = []
        for opt in subs:
            if counts_here(opt, hs):
                params += opt.get_parameters()
        return count_zeros_fp32(params, grad_stats_parallel_group=hs.world_group,
                                use_decoupled_grad=subs[0].config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    return count_zeros


def _main_and_model_params(opt) -> list[tuple[torch.Tensor, torch.Tensor, int | None]]:
    """(main parameter, model parameter, start of the main parameter's range in the model
    parameter; None: the whole) of a Megatron sub-optimizer: its fp32 copies of 16-bit
    parameters, its fp32 parameters themselves, a distributed optimizer's shards."""
    if hasattr(opt, "shard_fp32_groups"):  # DistributedOptimizer
        out = []
        for models, mains in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                              (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for model_group, main_group in zip(models, mains):
                for model, main in zip(model_group, main_group):
                    if main is not None:
                        out.append((main, model, opt._get_model_param_range_map(model)["param"].start))
        return out
    if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        pairs = [(main, model) for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                 for model, main in zip(models, mains)]
        return [(main, model, None) for main, model in pairs] + [
            (p, p, None) for group in opt.fp32_from_fp32_groups for p in group]
    return [(p, p, None) for p in opt.get_parameters()]  # FP32Optimizer


def _megatron_grads_for_norm(opt, group: str | None) -> list[torch.Tensor]:
    """The gradients Megatron's own filter puts in a sub-optimizer's norm (not None, not shared,
    not a tensor-parallel duplicate; megatron-core 0.19: of the main norm, or of one separate
    grad-norm group), read from the class so that an instance's replacement is bypassed."""
    cls = type(opt)
    if hasattr(cls, "get_grads_for_grad_norm"):  # megatron-core 0.19
        return cls.get_grads_for_grad_norm(opt, group)
    return cls.get_main_grads_for_grad_norm(opt) if group is None else []  # 0.16: no separate groups


def world_grad_norm(optimizer, chunks: list, hs: HeteroParallelState) -> Callable[[str | None], float]:
    """The world's L2 gradient norm as clipping uses it, the same wherever the experts sit.
    Why: Megatron adds each rank's squares and reduces the ranks' sums; an expert moved to another
    rank (a live move) regroups those partial sums, so the norm's rounding and, with clipping, the
    update changed (rel 6.1e-8 in the norm measured, 5e-7 in a later loss). Here each parameter (each
    expert of a GroupedMLP weight) has a slot of its own, named canonically (a dense parameter with
    its rank too: a tensor-parallel shard; a distributed optimizer's shard with its range's start);
    each rank puts its squared norms in its slots, one all-reduce adds them (one contributor per
    slot: exact) and every rank sums the slots in the same sorted order. A distributed optimizer
    whose expert shards span several ranks (ZP groups > 1) shards an expert differently per layout:
    its norm is right but not placement-invariant. Counted as before (counts_here: dense on
    attention DP rank 0, experts in ZP group 0, every shard). Returns norm(group): the main norm
    (None) or, on megatron-core 0.19, that of a separate grad-norm group (the MTP block's)."""
    from megatron_hetermoe.models.builder import canonical_names, unwrap
    from megatron_hetermoe.plan import expert_names

    canonical: dict[int, str] = {}
    for chunk in chunks:
        module = unwrap(chunk)
        names = module.canonical_names() if hasattr(module, "canonical_names") else canonical_names(module)
        canonical.update({id(p): names[n] for n, p in module.named_parameters()})
    subs = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if counts_here(o, hs)]
    # main parameter -> (its slots' keys, the gradient cut into one piece per slot)
    slots_of: dict[int, tuple[list[str], Callable[[torch.Tensor], list[torch.Tensor]]]] = {}
    whole = lambda g: [g]  # noqa: E731
    for opt in subs:
        for main, model, start in _main_and_model_params(opt):
            name = canonical[id(model)]
            if start is not None and main.numel() != model.numel():  # a part of the parameter
                slots_of[id(main)] = ([f"{name}@{hs.rank}:{start}"], whole)
            elif not _is_expert(model):
                slots_of[id(main)] = ([f"{name}@{hs.rank}"], whole)
            elif expert_names.is_label(name):  # a GroupedMLP weight: one slot per expert
                slots_of[id(main)] = (expert_names.label_members(name), lambda g, n=name, shape=model.shape: list(
                    expert_names.unpack(n, g.view(shape)).values()))
            else:
                slots_of[id(main)] = ([name], whole)
    mine = sorted({k for keys, _ in slots_of.values() for k in keys})
    every: list = [None] * dist.get_world_size(hs.world_group)
    dist.all_gather_object(every, mine, group=hs.world_group)
    slot = {k: i for i, k in enumerate(sorted(set().union(*every)))}
    decoupled = bool(getattr(getattr(optimizer, "config", None), "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                             False))

    def norm(group: str | None = None) -> float:
        keys, grads = [], []
        for opt in subs:
            main_of = {id(getattr(p, "decoupled_grad", None) if decoupled else p.grad): p
                       for p in opt.get_parameters()}
            for g in _megatron_grads_for_norm(opt, group):
                names, split = slots_of[id(main_of[id(g)])]
                keys += [slot[k] for k in names]
                grads += split(g)
        squares = torch.zeros(len(slot), dtype=torch.float64, device=hs.device)
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).double()  # main gradients: fp32
            squares.index_put_((torch.tensor(keys, device=hs.device),), norms * norms, accumulate=True)
        dist.all_reduce(squares, group=hs.world_group)
        return squares.sum().item() ** 0.5

    return norm
