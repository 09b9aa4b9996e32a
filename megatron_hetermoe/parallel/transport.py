"""The split-size token backends: all-to-all over a ZP group's communicators, and loopback.

Both implement parallel/extension.py's `Transport` and make `SplitRoute`s: a (layer, microbatch)'s
counts exchange tells every member how many rows each member sends each member, and every
transfer of the route is one all_to_all_single with those split sizes. Each direction has its
own communicator, so the two can be in flight at once:
- `to_experts`   "dispatch": forward dispatch, and the gradient of combine;
- `to_attention` "combine": forward combine, and the gradient of dispatch;
the counts exchange runs on the dispatch communicator, or asynchronously on a third, the counts
one (the single issuer's: its split sizes travel ahead of the payloads queued on dispatch).
`dispatch`/`combine` are the autograd pair (backward is the reverse transfer), used where autograd
drives the transfers (DistEP: Megatron's own schedule and the expert mirror); zebra issues the
four transfers as separate tasks.

Every member calls every transfer in the same order, whether it sends or receives anything: a
rank with nothing to send passes None (an empty [0, H] send).

Tokens travel as raw bytes, so every member sends the route's `dtype`, the wire dtype: the same
on every rank (HeteroParallelState.wire_dtype, the expert pool's precision; with one precision
on every rank, the world's params_dtype). A rank computes in its own dtype (`compute`, its
TransformerConfig's params_dtype): each transfer casts what it sends from it to the wire dtype
(and refuses any third dtype), and whoever consumes a received tensor casts it back with
`arrived`, so with per-pool precision (config.PoolPrecision) the cast sits at the boundary,
inside the autograd graph of the rank that computes on it. With one precision both casts are
no-ops.

- `AllToAllTransport`: all_to_all_single over the ZP group's process groups (parallel/state.py).
- `LoopbackTransport`: a ZP group of one rank (every expert on the one attention rank): rows
  stay where they are, with no collective; also what lets zebra's compute run in one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_hetermoe.parallel.extension import Work, ZPGeometry
from megatron_hetermoe.reliability import faults
from megatron_hetermoe.vocabulary import StreamName

DIRECTIONS = (StreamName.DISPATCH, StreamName.COMBINE)


class RowMover(Protocol):
    """What a SplitRoute moves its rows with: its split-size transport."""

    def move(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], direction: str,
             async_op: bool = False): ...


@dataclass(frozen=True)
class SplitRoute:
    """The split-size backends' Route (parallel/extension.py): the rows this rank sends to and
    receives from each member, fixed by the counts exchange."""
    send_splits: tuple[int, ...]  # rows this rank sends to each member (comm order)
    recv_splits: tuple[int, ...]  # rows this rank receives from each member
    local_counts: torch.Tensor  # [source member, local expert], on the host: tokens for this rank's experts
    transport: RowMover
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
    def from_counts(cls, geometry: ZPGeometry, transport: RowMover, layer: int, all_counts: torch.Tensor,
                    width: int, dtype: torch.dtype) -> "SplitRoute":
        """The route of `layer` from the counts exchange's [member, expert in travel order] result;
        dtype: this rank's compute dtype (the wire dtype is geometry.wire_dtype, or this where that
        is None). Everything a route needs on the host (both split sizes, the local experts' counts)
        comes from one host copy of `all_counts` (a no-op where it is already there): this rank's
        own row is what it sends. The rank's load meter, if any, counts what its experts receive."""
        host = all_counts.cpu()
        local = geometry.received_counts(layer, host)
        bounds, start = [], 0
        for size in geometry.member_sizes(layer):
            bounds.append((start, start + size))
            start += size
        # One host list, summed in Python: a tensor op per (member, member) pair would cost
        # milliseconds a route at 16 members, on every (layer, microbatch).
        pairs = tuple(tuple(sum(row[a:b]) for a, b in bounds) for row in host.tolist())
        if geometry.load_meter is not None:
            geometry.load_meter.observe(layer, geometry.local_experts(layer), local.sum(0).tolist())
        return cls(pairs[geometry.comm_order.index(geometry.rank)], tuple(local.sum(1).tolist()), local, transport,
                   width, geometry.wire_dtype or dtype, geometry.device, dtype, layer_tokens=int(host.sum()),
                   pair_rows=pairs)

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
            raise TypeError(f"SplitRoute.{what}: sending a {x.dtype} tensor on a {self.dtype} route whose rank "
                            f"computes in {self.local_dtype}; send the compute or the wire dtype")
        return x.to(self.dtype)

    def arrived(self, x: torch.Tensor) -> torch.Tensor:
        """A received (wire dtype) tensor in this rank's compute dtype; call it where the tensor is
        consumed, so the cast is part of the consumer's autograd graph."""
        return x.to(self.local_dtype)

    # ---- raw transfers (zebra's tasks) ------------------------------------------------------
    def to_experts(self, x: torch.Tensor | None, async_op: bool = False):
        """Attention -> experts, "dispatch" (forward dispatch, gradient of combine)."""
        return self.transport.move(self._wire(x, "to_experts"), list(self.recv_splits), list(self.send_splits),
                                   StreamName.DISPATCH, async_op)

    def to_attention(self, x: torch.Tensor | None, async_op: bool = False):
        """Experts -> attention, "combine" (forward combine, gradient of dispatch)."""
        return self.transport.move(self._wire(x, "to_attention"), list(self.send_splits), list(self.recv_splits),
                                   StreamName.COMBINE, async_op)

    # ---- autograd transfers (DistEP) ----------------------------------------------------------
    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        return _Transfer.apply(x, self, True)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return _Transfer.apply(y, self, False)


class _Transfer(torch.autograd.Function):
    """A transfer whose backward is the reverse one; in and out in the rank's compute dtype."""

    @staticmethod
    def forward(ctx, x, route: SplitRoute, to_experts: bool):
        ctx.route, ctx.to_experts, ctx.dtype = route, to_experts, x.dtype
        return route.arrived(route.to_experts(x) if to_experts else route.to_attention(x))

    @staticmethod
    def backward(ctx, grad):
        r = ctx.route
        return (r.to_attention(grad) if ctx.to_experts else r.to_experts(grad)).to(ctx.dtype), None, None


class _SplitTransport:
    """The Transport methods both split-size backends share: a route is made from the counts
    exchange (`counts`) and the ZP group's `geometry`, its rows moved by `move`."""
    geometry: ZPGeometry

    def counts(self, counts: torch.Tensor, async_op: bool = False):
        """Every member sends its int64 count vector to every member: [members, len(counts)], row k
        what member k sent (with async_op: (that buffer, its Work))."""
        raise NotImplementedError

    def move(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], direction: str,
             async_op: bool = False):
        """Send x's rows in_splits[k] to member k and receive out_splits[k] rows from member k, in
        `direction` (DIRECTIONS)."""
        raise NotImplementedError

    def _counts_of(self, layer: int, per_expert: torch.Tensor | None) -> torch.Tensor:
        """What a rank sends in the counts exchange: its int64 token count per expert of `layer` in
        travel order; zeros on a rank that routes nothing (an expert rank)."""
        g = self.geometry
        if per_expert is None:
            return torch.zeros(len(g.layer_order(layer)), dtype=torch.int64, device=g.device)
        return per_expert.to(torch.int64)

    def route(self, layer: int, per_expert: torch.Tensor | None, width: int, dtype: torch.dtype,
              stamp: int | None = None) -> tuple[SplitRoute, int | None]:
        counts = self._counts_of(layer, per_expert)
        if stamp is not None:
            counts = torch.cat([counts, torch.tensor([stamp], dtype=torch.int64, device=counts.device)])
        allc = self.counts(counts).cpu()  # the one host read of this (layer, microbatch)
        got = None
        if stamp is not None:
            got, allc = int(allc[:, -1].max()), allc[:, :-1]
        return self.finish_route(layer, allc, width, dtype), got

    def start_route(self, layer: int, per_expert: torch.Tensor | None) -> tuple[torch.Tensor, Work]:
        return self.counts(self._counts_of(layer, per_expert), async_op=True)

    def finish_route(self, layer: int, all_counts: torch.Tensor, width: int, dtype: torch.dtype) -> SplitRoute:
        return SplitRoute.from_counts(self.geometry, self, layer, all_counts, width, dtype)


class AllToAllTransport(_SplitTransport):
    """all_to_all_single over the ZP group's dispatch, combine and counts process groups."""

    def __init__(self, geometry: ZPGeometry, dispatch_group, combine_group, counts_group):
        self.groups = {"dispatch": dispatch_group, "combine": combine_group, "counts": counts_group}
        self.geometry = geometry
        self.members = dist.get_world_size(dispatch_group)
        self.backend = str(dist.get_backend(dispatch_group))

    def counts(self, counts: torch.Tensor, async_op: bool = False):
        faults.checkpoint("exchange", "counts")
        n = self.members
        send = counts.to(torch.int64).repeat(n)
        recv = torch.empty_like(send)
        group = self.groups["counts" if async_op else "dispatch"]
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        if async_op:
            return recv.view(n, -1), work
        work.wait()
        return recv.view(n, -1)

    def move(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], direction: str,
             async_op: bool = False):
        faults.checkpoint("exchange", "tokens")
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.groups[direction],
                                      async_op=True)
        if async_op:
            return out, work
        work.wait()  # on NCCL the current stream waits, as a synchronous call would
        return out

    def latest(self, value: float, direction: str) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.geometry.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups[direction])
        return float(t)


class _Done:
    """A Work that has completed."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LoopbackTransport(_SplitTransport):
    """A ZP group of one rank: what it sends it receives, with no collective (the backend names
    the world's, for the executors' choice)."""
    members = 1

    def __init__(self, geometry: ZPGeometry, backend: str):
        self.geometry, self.backend = geometry, backend

    def counts(self, counts: torch.Tensor, async_op: bool = False):
        faults.checkpoint("exchange", "counts")
        out = counts.to(torch.int64).view(1, -1)
        return (out, _Done()) if async_op else out

    def move(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], direction: str,
             async_op: bool = False):
        faults.checkpoint("exchange", "tokens")
        if list(out_splits) != list(in_splits) or sum(in_splits) != x.shape[0]:
            raise ValueError(f"loopback {direction}: {x.shape[0]} rows sent as {list(in_splits)} cannot arrive as "
                             f"{list(out_splits)}")
        return (x, _Done()) if async_op else x

    def latest(self, value: float, direction: str) -> float:
        return value
