"""Megatron's logged model statistics (--log-params-norm, --log-num-zeros-in-grad) over a HeterMoE
world, each parameter counted once.

Megatron counts each parameter once by its groups: dense parameters over the model-parallel group,
expert parameters over the expert-model-parallel one. On a HeterMoE world the copies sit elsewhere:
every attention rank holds the dense parameters (data parallel), and the experts of a layer are
spread over the attention and expert ranks of each ZP group, one copy per group. A parameter
counts on its owner (RankLayout.owns_gradient: dense on attention DP rank 0, experts in ZP group
0), a distributed optimizer's shard on the rank that holds it; one sum over the world, so every
rank, the logging rank included, gets the one value.
"""
from __future__ import annotations

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
