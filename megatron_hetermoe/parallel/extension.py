"""The extension protocols: what a new backend implements, all in one place.

Token transport (how a ZP group moves tokens between its attention and expert ranks):
- `Transport`: the backend. It makes a `Route` per (layer, microbatch) from the counts exchange
  and agrees on when a transfer could start (emulation). `HeteroParallelState.transport` picks it
  (parallel/transport.py: all-to-all over the ZP group's communicators, or loopback in a group of
  one rank).
- `Route`: the backend-owned handle of one (layer, microbatch). Dispatch, combine and both their
  gradients take the handle: the executors (zebra's tasks, the DistEP dispatcher and expert
  mirror) call nothing else, so a node-level dedup transport or another backend brings its own
  Route (its own split sizes, indexes, buffers) without touching them.
- `ZPGeometry`: what a transport reads of its ZP group's placement (HeteroParallelState has it).

Time (`TaskTiming`, `ReceivedTokens`): how long a task takes on the machine a run stands for;
emulation (emulation/timing.py) implements it, the executors call it (schedules/timing.py).

Data (`MicrobatchSource`): where the plugin trainer's microbatches come from (data/dataset.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_hetermoe.plan.tasks import Task


class Work(Protocol):
    """An issued transfer (torch.distributed's Work, or a completed stand-in). The single issuer
    polls it without waiting (schedules/issuer.py): its `get_future()`, where it has one, or else
    `is_completed()`, which must turn true without a wait() (gloo's send/recv Work does not)."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class ZPGeometry(Protocol):
    """A rank's view of its ZP group's placement, as a transport needs it."""
    rank: int
    device: torch.device
    wire_dtype: torch.dtype | None  # the dtype tokens cross roles in (None: each rank's own, one precision)
    load_meter: Any  # parallel/expert_load.ExpertLoadMeter, or None: counts what this rank's experts receive

    @property
    def comm_order(self) -> list[int]:
        """The group's ranks in the order split sizes refer to them (ascending global rank)."""

    def layer_order(self, layer: int) -> list[int]:
        """Expert ids of `layer` in travel order: holder by holder in comm_order."""

    def member_sizes(self, layer: int) -> list[int]:
        """Experts of `layer` each member holds, in comm_order."""

    def local_experts(self, layer: int) -> list[int]:
        """Expert ids of `layer` this rank holds."""

    def received_counts(self, layer: int, all_counts: torch.Tensor) -> torch.Tensor:
        """[member, local expert] tokens this rank receives, from the counts exchange's result."""


class Route(Protocol):
    """How one layer's tokens of one microbatch travel within a ZP group, seen from this rank.

    The contract with the executors: an expert holder receives its rows grouped by source member
    (comm order), then by local expert (its placement's order), `local_counts[m, e]` rows each;
    an attention rank gets back exactly the rows it dispatched, in its own order. Every member
    calls every transfer of the route in the same order, whether it sends anything or not."""
    local_counts: torch.Tensor  # [source member, local expert], on the host
    layer_tokens: int  # rows every member routed in this (layer, microbatch), all experts of the layer
    # Rows member i sends member j in the dispatch direction (comm order), the same on every member:
    # what an emulated transfer is priced for (TaskTiming.transfer).
    pair_rows: tuple[tuple[int, ...], ...]

    def empty(self) -> torch.Tensor:
        """A send of nothing ([0, width] in the wire dtype)."""

    def arrived(self, x: torch.Tensor) -> torch.Tensor:
        """A received tensor in this rank's compute dtype (call it where the tensor is consumed)."""

    def to_experts(self, x: torch.Tensor | None, async_op: bool = False):
        """Attention -> experts: forward dispatch, and the gradient of combine. x: this rank's rows
        (None: it sends nothing). Returns the received tensor (async_op: it and its Work)."""

    def to_attention(self, x: torch.Tensor | None, async_op: bool = False):
        """Experts -> attention: forward combine, and the gradient of dispatch."""

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """to_experts as an autograd function (its backward is to_attention)."""

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """to_attention as an autograd function (its backward is to_experts)."""


class Transport(Protocol):
    members: int  # ranks of the ZP group (of this rank's pipeline stage)
    backend: str  # the communicators' backend: what the executors choose by (schedules/issuer.py)

    def route(self, layer: int, per_expert: torch.Tensor | None, width: int, dtype: torch.dtype,
              stamp: int | None = None) -> tuple[Route, int | None]:
        """The counts exchange of `layer` and the Route it fixes. per_expert: this rank's tokens
        per expert of the layer in travel order (None: it routes nothing, an expert rank); width:
        the hidden size; dtype: this rank's compute dtype. `stamp`: an int every member adds to the
        exchange, the largest comes back (emulation: when the last member could start)."""

    def start_route(self, layer: int, per_expert: torch.Tensor | None) -> tuple[torch.Tensor, Work]:
        """The counts exchange of `layer`, issued asynchronously (the single issuer's): (the
        received counts, its Work); `finish_route` makes the Route once they arrived."""

    def finish_route(self, layer: int, all_counts: torch.Tensor, width: int, dtype: torch.dtype) -> Route:
        """The Route of `layer` from `start_route`'s received counts."""

    def latest(self, value: float, direction: str) -> float:
        """The largest `value` over the members, agreed on `direction`'s communicator (emulation:
        when a transfer could start)."""


@dataclass(frozen=True)
class ReceivedTokens:
    """What an expert task's experts received: tokens per local expert (this rank's experts of
    the layer, in its placement's order) and the layer's mean tokens per expert over all its
    experts in the same microbatch (every member's routed rows / experts)."""
    received: tuple[int, ...]
    mean: float

    def multipliers(self) -> tuple[float, ...]:
        """Each local expert's tokens over the layer's mean (1.0: its balanced share)."""
        if self.mean <= 0:
            return (0.0,) * len(self.received)
        return tuple(c / self.mean for c in self.received)


class TaskTiming(Protocol):
    def origin(self) -> float:
        """The step's time origin (time.perf_counter seconds): when its first task could start."""

    def compute(self, task: Task, start: float, real_end: float, tokens: ReceivedTokens | None = None) -> float:
        """A compute task that could start at `start` and whose real work ended at `real_end`:
        wait until its emulated end, record its window; return when it ended. `tokens`: what an
        expert task's experts received (None: price the plan's balanced share)."""

    def transfer(self, task: Task, start: float, real_end: float,
                 rows: tuple[tuple[int, ...], ...] | None = None) -> float:
        """The same for a transfer, `start` being when its last member could start it (the
        executors agree on it with Transport.latest). `rows`: a token transfer's Route.pair_rows
        (None: price the plan's balanced routing)."""


class MicrobatchSource(Protocol):
    def microbatch(self, step: int, microbatch: int, micro_batch_size: int, global_batch_size: int) -> dict: ...
