"""How one ZP group moves tokens: the seam every token transfer goes through.

A `Transport` knows the members of a rank's ZP group and moves rows between them in one of two
directions, each on its own communicator so the two can be in flight at once:
- "dispatch": attention -> experts (forward dispatch, and the gradient of combine);
- "combine":  experts -> attention (forward combine, and the gradient of dispatch);
plus the counts exchange that fixes the split sizes of a route (on the dispatch communicator,
or asynchronously on a third one, the single issuer's), and `latest`, the largest of a value
over the members on a direction's communicator (emulation agrees there when a transfer could
start). Every member calls every operation in the same order, whether it sends rows or not.
Sync calls return the received tensor; `async_op=True` returns it with a Work to wait on.

Implementations:
- `AllToAllTransport`: all_to_all_single over the ZP group's process groups (parallel/state.py).
- `LoopbackTransport`: a ZP group of one rank (every expert on the one attention rank): rows
  stay where they are, with no collective; also what lets zebra's compute run in one process.
A new dispatcher (DeepEP-style, point-to-point) implements the same four operations and
`HeteroParallelState.transport` picks it.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron_hetermoe.reliability import faults
from megatron_hetermoe.vocabulary import StreamName

DIRECTIONS = (StreamName.DISPATCH, StreamName.COMBINE)


class Transport(Protocol):
    members: int  # ranks of the ZP group
    backend: str  # what the executors choose by (schedules/issuer.py resolve_issuer)

    def counts(self, counts: torch.Tensor, async_op: bool = False):
        """Every member sends its int64 count vector to every member: [members, len(counts)], row
        k what member k sent (with async_op: (that buffer, its Work), on the counts communicator)."""

    def move(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], direction: str,
             async_op: bool = False):
        """Send x's rows in_splits[k] to member k and receive out_splits[k] rows from member k, in
        `direction` (DIRECTIONS)."""

    def latest(self, value: float, direction: str) -> float:
        """The largest `value` over the members, agreed on `direction`'s communicator."""


class AllToAllTransport:
    """all_to_all_single over the ZP group's dispatch, combine and counts process groups."""

    def __init__(self, dispatch_group, combine_group, counts_group, device: torch.device):
        self.groups = {"dispatch": dispatch_group, "combine": combine_group, "counts": counts_group}
        self.device = device
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
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups[direction])
        return float(t)


class _Done:
    """A Work that has completed."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LoopbackTransport:
    """A ZP group of one rank: what it sends it receives, with no collective (the backend names
    the world's, for the executors' choice)."""
    members = 1

    def __init__(self, backend: str = "gloo"):
        self.backend = backend

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
