"""Every collective an attention rank and an expert rank share goes through here.

`exchange` is an all_to_all_single over one ZP group whose backward is the reverse
all_to_all over the *other* group (see hetero_parallel_state: one group per direction).
Every member calls it, in the same order, whether it sends or receives anything: a rank with
nothing to send passes an empty [0, H] tensor, and one with nothing to receive gets one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hetermoe.reliability import faults


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    faults.checkpoint("exchange", "tokens")
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, fwd_group, bwd_group):
        ctx.splits = (out_splits, in_splits)
        ctx.bwd_group = bwd_group
        return _a2a(x, out_splits, in_splits, fwd_group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.bwd_group), None, None, None, None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], fwd_group, bwd_group) -> torch.Tensor:
    """Send x[in_splits[k] rows] to member k and receive out_splits[k] rows from member k."""
    return _Exchange.apply(x, list(map(int, out_splits)), list(map(int, in_splits)), fwd_group, bwd_group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every member sends its per-expert token counts (in the layer's travel order) to every
    member; returns [members, experts]: row k = what member k sends, per expert."""
    faults.checkpoint("exchange", "counts")
    n = dist.get_world_size(group)
    send = counts.to(torch.int64).repeat(n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(n, -1)
