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

import math
from typing import Callable, Iterable

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
    dist.all_reduce(squares, group=hs.group("world"))
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
        return count_zeros_fp32(params, grad_stats_parallel_group=hs.group("world"),
                                use_decoupled_grad=subs[0].config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    return count_zeros


def _megatron_grads_for_norm(opt, group: str | None) -> list[torch.Tensor]:
    """The gradients Megatron's own filter puts in a sub-optimizer's norm (not None, not shared,
    not a tensor-parallel duplicate; megatron-core 0.19: of the main norm, or of one separate
    grad-norm group), read from the class so that an instance's replacement is bypassed."""
    cls = type(opt)
    if hasattr(cls, "get_grads_for_grad_norm"):  # megatron-core 0.19
        return cls.get_grads_for_grad_norm(opt, group)
    return cls.get_main_grads_for_grad_norm(opt) if group is None else []  # 0.16: no separate groups


# What world_square_sum drops is below 2**-ACCURACY_BITS of the largest square (so of the sum): the
# clipping coefficient Megatron computes from it is fp32 (2**-24).
ACCURACY_BITS = 40


def _fold_steps(peak: float, n_bits: int) -> list[float]:
    """The splitters of world_square_sum's folds: fold k rounds each value to a multiple of a grid
    step u_k by (v + s_k) - s_k, s_k = 1.5 * 2**52 * u_k; u_1 = 2**(e + n_bits - 52) with peak below
    2**e, so at most 2**(n_bits - 1) grid values of magnitude <= 2**e add up below 2**53 * u_1: every
    sum of them, in any order and grouping, is exact. A fold's remainders are at most u_k / 2, the
    next fold's peak. Folds go on until the dropped remainders, at most 2**(n_bits - 1) * u_K / 2,
    are below 2**-ACCURACY_BITS of the peak."""
    if not 1 <= n_bits <= 44:  # each fold must gain bits: 52 - n_bits of them
        raise ValueError(f"world_square_sum: 2**{n_bits - 1} elements is beyond the folds' range (2**43)")
    _, e = math.frexp(peak)  # peak = m * 2**e, m in [0.5, 1): peak < 2**e, peak >= 2**(e-1)
    steps, u_exp = [], e + n_bits - 52  # grid step 2**u_exp
    while True:
        steps.append(1.5 * 2.0 ** (u_exp + 52))
        if u_exp + n_bits - 2 < e - 1 - ACCURACY_BITS or u_exp < -1074 + 52:  # negligible, or subnormal grids
            return steps
        u_exp = u_exp - 1 + n_bits - 52  # the remainders' bound u/2 is the next fold's 2**e


def fold_sums(values: Iterable[torch.Tensor], steps: list[float],
              device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Per fold of _fold_steps, the exact sum of every tensor's values rounded to its grid (the
    remainders go to the next fold): float64 [len(steps)] on `device`. `values`: float64, one at a
    time (a generator keeps one float64 copy of a gradient alive, not all of them)."""
    out = torch.zeros(len(steps), dtype=torch.float64, device=device)
    for v in values:
        for k, s in enumerate(steps):
            hi = (v + s) - s  # v on fold k's grid (exact: no rounding past the grid)
            out[k] += hi.sum()
            v = v - hi  # exact
    return out


def world_square_sum(grads: list[torch.Tensor], group, device: torch.device, n_bits: int) -> float:
    """The sum of the squares of every element of `grads` over `group`'s ranks, the same bits
    however the elements are spread over ranks, tensors and shards: each square is exact in float64
    (fp32 or narrower gradients), and is summed in folds on grids fixed by the group's largest
    square and `n_bits` (2**(n_bits-1) >= the group's element count; _fold_steps), where adding
    is exact in any order; only the folds' few totals are rounded, in a fixed order. What the last
    fold leaves is dropped: below 2**-ACCURACY_BITS of the sum. Two all-reduces: the largest
    square, the folds' sums (2 folds up to 2**20 elements in the world, 4 at 2**30, 5 at 2**35;
    each a pass over the gradients in float64)."""
    peak = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():  # the largest square is the largest magnitude's, squared exactly in float64
            peak = torch.maximum(peak, g.detach().abs().max().double().square())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    top = peak.item()
    if not math.isfinite(top) or top == 0.0:  # inf or nan (an overflowed step) as Megatron's norm gives it
        return top
    steps = _fold_steps(top, n_bits)
    sums = fold_sums((g.detach().double().square() for g in grads), steps, device)
    dist.all_reduce(sums, group=group)
    total = 0.0
    for x in sums.tolist():  # largest fold first: a fixed order (not sum(): Python 3.12's compensates)
        total += x
    return total


def world_grad_norm(optimizer, hs: HeteroParallelState) -> Callable[[str | None], float]:
    """The world's L2 gradient norm as clipping uses it, the same bits wherever the experts sit.
    Why: Megatron adds each rank's squares and reduces the ranks' sums; an expert moved to another
    rank (a live move), or a distributed optimizer's shard cut elsewhere in the moved bucket layout,
    regroups those partial sums, so the norm's rounding and, with clipping, the update changed (rel
    6.1e-8 in the norm measured, 5e-7 in a later loss). Here the squares are summed exactly
    (world_square_sum), so no grouping shows. Counted as before (counts_here: dense on attention DP
    rank 0, experts in ZP group 0, every distributed optimizer's shard), by Megatron's own filter
    of each sub-optimizer's gradients. Returns norm(group): the main norm (None) or, on megatron-core
    0.19, that of a separate grad-norm group (the MTP block's)."""
    subs = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if counts_here(o, hs)]
    # The grid's headroom: 2**(n_bits-1) >= every element the world counts (each sub-optimizer's
    # parameters, shards included: the same total in every layout), taken once here.
    count = torch.tensor([sum(p.numel() for opt in subs for p in opt.get_parameters())], dtype=torch.float64,
                         device=hs.device)
    dist.all_reduce(count, group=hs.group("world"))
    n_bits = max(1, math.ceil(math.log2(count.item() + 1))) + 1

    def norm(group: str | None = None) -> float:
        grads = [g for opt in subs for g in _megatron_grads_for_norm(opt, group)]
        return world_square_sum(grads, hs.group("world"), hs.device, n_bits) ** 0.5

    return norm
