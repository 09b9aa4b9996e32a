"""A `TokenRoute`: how one layer's tokens of one microbatch travel within a ZP group.

A route is made once per (layer, microbatch) by the counts exchange (on the transport's dispatch
communicator; the single issuer, schedules/issuer.py, runs it asynchronously on the counts one):
every member of the ZP group sends its per-expert token counts (in the layer's travel order) to
every member, which fixes how many rows each member sends to and receives from each other
member. Tokens then move through the rank's Transport (parallel/transport.py), one direction each:
- `to_experts`   "dispatch": forward dispatch, and the gradient of combine;
- `to_attention` "combine": forward combine, and the gradient of dispatch.
`dispatch`/`combine` are the autograd pair (backward is the reverse transfer), used where
autograd drives the transfers (DistEP: Megatron's own schedule and the expert mirror). Zebra
issues the four transfers as separate tasks with the raw methods.

Every member calls every transfer in the same order, whether it sends or receives anything: a
rank with nothing to send passes an empty [0, H] tensor (`route.empty()`).

Tokens travel as raw bytes, so every member sends the route's `dtype`, the wire dtype: the same
on every rank (HeteroParallelState.wire_dtype, the expert pool's precision; with one precision
on every rank, the world's params_dtype). A rank computes in its own dtype (`compute`, its
TransformerConfig's params_dtype): each transfer casts what it sends from it to the wire dtype
(and refuses any third dtype), and whoever consumes a received tensor casts it back with
`arrived`, so with per-pool precision (config.PoolPrecision) the cast sits at the boundary,
inside the autograd graph of the rank that computes on it. With one precision both casts are
no-ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.parallel.transport import Transport
from megatron_hetermoe.vocabulary import StreamName

# A transfer's issue: (x, out_splits, in_splits, direction) -> what Transport.move returns; zebra
# wraps the transport's to time it (emulation) or to issue it asynchronously.
Move = Callable[[torch.Tensor, list, list, str], object]


def _counts_of(hs: HeteroParallelState, layer: int, per_expert: torch.Tensor | None) -> torch.Tensor:
    """What a rank sends in the counts exchange: its int64 token count per expert of `layer` in
    travel order; zeros on a rank that routes nothing (an expert rank)."""
    if per_expert is None:
        return torch.zeros(len(hs.layer_order(layer)), dtype=torch.int64, device=hs.device)
    return per_expert.to(torch.int64)


@dataclass(frozen=True)
class TokenRoute:
    """How one layer's tokens of one microbatch travel within a ZP group, seen from this rank."""
    send_splits: tuple[int, ...]  # rows this rank sends to each member (comm order)
    recv_splits: tuple[int, ...]  # rows this rank receives from each member
    local_counts: torch.Tensor  # [source member, local expert], on the host: tokens for this rank's experts
    transport: Transport
    width: int
    dtype: torch.dtype  # the wire dtype: every member sends and receives this
    device: torch.device
    compute: torch.dtype | None = None  # this rank's dtype (None: the wire dtype)
    # Rows every member routed in this (layer, microbatch), for all experts of the layer: with
    # local_counts, the load this rank's experts got against the layer's mean (emulated expert
    # times, parallel/expert_load.py).
    layer_tokens: int = 0
    # Rows member i sends member j in the dispatch direction (comm order), known on every member
    # from the counts exchange: what an emulated transfer is priced for (schedules/timing.py).
    pair_rows: tuple[tuple[int, ...], ...] = ()

    @property
    def local_dtype(self) -> torch.dtype:
        return self.compute or self.dtype

    @classmethod
    def exchange(cls, hs: HeteroParallelState, layer: int, per_expert: torch.Tensor | None, width: int,
                 dtype: torch.dtype, stamp: int | None = None) -> tuple["TokenRoute", int | None]:
        """The counts exchange of `layer` (on the transport's dispatch communicator). per_expert: this
        rank's token count per expert of the layer in travel order, None on a rank that routes
        nothing (an expert rank). dtype: this rank's compute dtype (its params_dtype; the wire
        dtype is hs.wire_dtype, or this where that is None). `stamp`: an
        int every member adds; the maximum comes back (emulation carries when each member could
        start the transfer)."""
        counts = _counts_of(hs, layer, per_expert)
        if stamp is not None:
            counts = torch.cat([counts, torch.tensor([stamp], dtype=torch.int64, device=counts.device)])
        allc = hs.transport.counts(counts).cpu()  # the one host read of this (layer, microbatch)
        got = None
        if stamp is not None:
            got, allc = int(allc[:, -1].max()), allc[:, :-1]
        return cls.from_counts(hs, layer, allc, width, dtype), got

    @staticmethod
    def start_exchange(hs: HeteroParallelState, layer: int,
                       per_expert: torch.Tensor | None) -> tuple[torch.Tensor, object]:
        """The counts exchange of `layer`, issued asynchronously on the counts communicator (the
        single issuer's: its split sizes travel ahead of the payloads queued in the dispatch
        direction). Returns (received counts, Work); `from_counts` makes the route once they arrived."""
        return hs.transport.counts(_counts_of(hs, layer, per_expert), async_op=True)

    @classmethod
    def from_counts(cls, hs: HeteroParallelState, layer: int, all_counts: torch.Tensor, width: int,
                    dtype: torch.dtype) -> "TokenRoute":
        """The route of `layer` from the counts exchange's [member, expert in travel order] result;
        dtype: this rank's compute dtype (as `exchange`). Everything a route needs on the host
        (both split sizes, the local experts' counts) comes from one host copy of `all_counts`
        (a no-op where it is already there): this rank's own row is what it sends. The rank's
        load meter (hs.load_meter), if any, counts the tokens its experts receive."""
        host = all_counts.cpu()
        local = hs.received_counts(layer, host)
        bounds, start = [], 0
        for size in hs.member_sizes(layer):
            bounds.append((start, start + size))
            start += size
        # One host list, summed in Python: a tensor op per (member, member) pair would cost
        # milliseconds a route at 16 members, on every (layer, microbatch).
        pairs = tuple(tuple(sum(row[a:b]) for a, b in bounds) for row in host.tolist())
        if hs.load_meter is not None:
            hs.load_meter.observe(layer, hs.local_experts(layer), local.sum(0).tolist())
        return cls(pairs[hs.comm_order.index(hs.rank)], tuple(local.sum(1).tolist()), local, hs.transport, width,
                   hs.wire_dtype or dtype, hs.device, dtype, layer_tokens=int(host.sum()), pair_rows=pairs)

    def empty(self) -> torch.Tensor:
        return torch.empty(0, self.width, dtype=self.dtype, device=self.device)

    def _wire(self, x: torch.Tensor | None, what: str) -> torch.Tensor:
        """x in the wire dtype, or an empty send. x is in this rank's compute dtype (cast here) or
        already the wire's; any other dtype is refused (a caller's bug: the peer would read its
        bytes as the wire dtype)."""
        if x is None:
            return self.empty()
        if x.dtype == self.dtype:
            return x
        if x.dtype != self.local_dtype:
            raise TypeError(f"TokenRoute.{what}: sending a {x.dtype} tensor on a {self.dtype} route whose rank "
                            f"computes in {self.local_dtype}; send the compute or the wire dtype")
        return x.to(self.dtype)

    def arrived(self, x: torch.Tensor) -> torch.Tensor:
        """A received (wire dtype) tensor in this rank's compute dtype; call it where the tensor is
        consumed, so the cast is part of the consumer's autograd graph."""
        return x.to(self.local_dtype)

    # ---- raw transfers (zebra's tasks) ------------------------------------------------------
    def to_experts(self, x: torch.Tensor | None, move: Move | None = None):
        """Attention -> experts, "dispatch" (forward dispatch, gradient of combine). Returns what
        `move` returns (default the transport's synchronous move: the received tensor)."""
        return (move or self.transport.move)(self._wire(x, "to_experts"), list(self.recv_splits),
                                             list(self.send_splits), StreamName.DISPATCH)

    def to_attention(self, x: torch.Tensor | None, move: Move | None = None):
        """Experts -> attention, "combine" (forward combine, gradient of dispatch)."""
        return (move or self.transport.move)(self._wire(x, "to_attention"), list(self.send_splits),
                                             list(self.recv_splits), StreamName.COMBINE)

    # ---- autograd transfers (DistEP) ----------------------------------------------------------
    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        return _Transfer.apply(x, self, True)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return _Transfer.apply(y, self, False)


class _Transfer(torch.autograd.Function):
    """A transfer whose backward is the reverse one; in and out in the rank's compute dtype."""

    @staticmethod
    def forward(ctx, x, route: TokenRoute, to_experts: bool):
        ctx.route, ctx.to_experts, ctx.dtype = route, to_experts, x.dtype
        return route.arrived(route.to_experts(x) if to_experts else route.to_attention(x))

    @staticmethod
    def backward(ctx, grad):
        r = ctx.route
        return (r.to_attention(grad) if ctx.to_experts else r.to_experts(grad)).to(ctx.dtype), None, None
