"""The one token transport between attention and expert ranks: a `TokenRoute`.

A route is made once per (layer, microbatch) by the counts exchange: every member of the ZP
group sends its per-expert token counts (in the layer's travel order) to every member, which
fixes how many rows each member sends to and receives from each other member. Tokens then move
with all_to_all_single over one group per direction (parallel/state.py):
- `to_experts`  on the dispatch group: forward dispatch, and the gradient of combine;
- `to_attention` on the combine group: forward combine, and the gradient of dispatch.
`dispatch`/`combine` are the autograd pair (backward is the reverse transfer on the other
group), used where autograd drives the transfers (DistEP: Megatron's own schedule and the
expert mirror). Zebra issues the four transfers as separate tasks with the raw methods.

Every member calls every collective in the same order, whether it sends or receives anything:
a rank with nothing to send passes an empty [0, H] tensor (`route.empty()`).

Tokens travel as raw bytes, so every member must send the route's `dtype` (the wire dtype):
both roles make it from their TransformerConfig's params_dtype, one world-wide precision
(plan/validation.py refuses per-pool precision), and each transfer checks what it sends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.reliability import faults

AllToAll = Callable[[torch.Tensor, list, list, object], torch.Tensor]


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send x's rows in_splits[k] to member k; receive out_splits[k] rows from member k."""
    faults.checkpoint("exchange", "tokens")
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every member sends its int64 count vector to every member; returns [members, len(counts)]:
    row k = what member k sent."""
    faults.checkpoint("exchange", "counts")
    n = dist.get_world_size(group)
    send = counts.to(torch.int64).repeat(n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(n, -1)


@dataclass(frozen=True)
class TokenRoute:
    """How one layer's tokens of one microbatch travel within a ZP group, seen from this rank."""
    send_splits: tuple[int, ...]  # rows this rank sends to each member (comm order)
    recv_splits: tuple[int, ...]  # rows this rank receives from each member
    local_counts: torch.Tensor  # [source member, local expert]: tokens for this rank's experts
    dispatch_group: object
    combine_group: object
    width: int
    dtype: torch.dtype  # the wire dtype: every member sends and receives this
    device: torch.device

    @classmethod
    def exchange(cls, hs: HeteroParallelState, layer: int, per_expert: torch.Tensor | None,
                 send_splits: list[int] | None, width: int, dtype: torch.dtype,
                 stamp: int | None = None) -> tuple["TokenRoute", int | None]:
        """The counts exchange of `layer` (collective over the dispatch group). per_expert: this
        rank's token count per expert of the layer in travel order, None on a rank that routes
        nothing (an expert rank). dtype: the wire dtype (the world's params_dtype). `stamp`: an
        int every member adds; the maximum comes back (emulation carries when each member could
        start the transfer)."""
        n = len(hs.zp.members)
        if per_expert is None:
            per_expert = torch.zeros(len(hs.layer_order(layer)), dtype=torch.int64, device=hs.device)
        counts = per_expert.to(torch.int64)
        if stamp is not None:
            counts = torch.cat([counts, torch.tensor([stamp], dtype=torch.int64, device=counts.device)])
        allc = exchange_counts(counts, hs.dispatch_group)
        got = None
        if stamp is not None:
            got, allc = int(allc[:, -1].max().item()), allc[:, :-1]
        local = hs.received_counts(layer, allc)
        route = cls(tuple(int(s) for s in (send_splits or [0] * n)), tuple(int(s) for s in local.sum(1).tolist()),
                    local, hs.dispatch_group, hs.combine_group, width, dtype, hs.device)
        return route, got

    def empty(self) -> torch.Tensor:
        return torch.empty(0, self.width, dtype=self.dtype, device=self.device)

    def _wire(self, x: torch.Tensor | None, what: str) -> torch.Tensor:
        """x, or an empty send; a tensor of another dtype than the wire's is refused (the peer
        would read its bytes as the wire dtype)."""
        if x is None:
            return self.empty()
        if x.dtype != self.dtype:
            raise TypeError(f"TokenRoute.{what}: sending a {x.dtype} tensor on a {self.dtype} route; every "
                            f"member must send the route's dtype (one --bf16/--fp16/fp32 precision on all ranks)")
        return x

    # ---- raw transfers (zebra's tasks) ------------------------------------------------------
    def to_experts(self, x: torch.Tensor | None, a2a: AllToAll = all_to_all) -> torch.Tensor:
        """Attention -> experts on the dispatch group (forward dispatch, gradient of combine)."""
        return a2a(self._wire(x, "to_experts"), list(self.recv_splits), list(self.send_splits),
                   self.dispatch_group)

    def to_attention(self, x: torch.Tensor | None, a2a: AllToAll = all_to_all) -> torch.Tensor:
        """Experts -> attention on the combine group (forward combine, gradient of dispatch)."""
        return a2a(self._wire(x, "to_attention"), list(self.send_splits), list(self.recv_splits),
                   self.combine_group)

    # ---- autograd transfers (DistEP) ----------------------------------------------------------
    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        return _Transfer.apply(x, self, True)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return _Transfer.apply(y, self, False)


class _Transfer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route: TokenRoute, to_experts: bool):
        ctx.route, ctx.to_experts = route, to_experts
        return route.to_experts(x) if to_experts else route.to_attention(x)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.route
        return (r.to_attention(grad) if ctx.to_experts else r.to_experts(grad)), None, None
