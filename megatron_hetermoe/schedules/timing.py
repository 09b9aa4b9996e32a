"""The executors' seam for time: how long a task takes on the machine a run stands for.

Without a `TaskTiming` a task takes as long as it runs. An emulated cluster (emulation/) passes
one that stretches every compute task and transfer to the emulated time: each starts when the
simulator says it could (the previous task ended and its input arrived; a transfer: when its
last member could start it), runs its real work, then sleeps out its emulated duration, and the
window is recorded for the run's validity verdict. The executors call it and import nothing of
emulation, so schedules stay below emulation in the layering.

An expert task (X_*, E_*) is timed for the tokens its experts received in that (layer,
microbatch) (`ReceivedTokens`, from the TokenRoute), not for the plan's balanced share: the
zebra rank passes them with the task (`LoadedTiming`), so an emulated step includes the
routing's skew. A token transfer (D_*, C_*) likewise is told the rows each member sends each
member in that (layer, microbatch) (the route's `pair_rows`, the same on every member)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from megatron_hetermoe.plan.tasks import Task


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
        executors exchange that with the transfer's route: TokenRoute.latest). `rows`: a token
        transfer's rows member i sends member j in the dispatch direction (comm order; None:
        price the plan's balanced routing)."""


class LoadedTiming:
    """A TaskTiming whose compute() is told what each expert task received: `received(task)`
    (None for other tasks). The executors keep calling compute(task, start, real_end)."""

    def __init__(self, timing: TaskTiming, received: Callable[[Task], ReceivedTokens | None]):
        self.timing, self.received = timing, received

    def origin(self) -> float:
        return self.timing.origin()

    def compute(self, task: Task, start: float, real_end: float) -> float:
        return self.timing.compute(task, start, real_end, self.received(task))

    def transfer(self, task: Task, start: float, real_end: float,
                 rows: tuple[tuple[int, ...], ...] | None = None) -> float:
        return self.timing.transfer(task, start, real_end, rows)
