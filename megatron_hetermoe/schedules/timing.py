"""The executors' seam for time: how long a task takes on the machine a run stands for.

Without a `TaskTiming` a task takes as long as it runs. An emulated cluster (emulation/) passes
one that stretches every compute task and transfer to the emulated time: each starts when the
simulator says it could (the previous task ended and its input arrived; a transfer: when its
last member could start it), runs its real work, then sleeps out its emulated duration, and the
window is recorded for the run's validity verdict. The executors call it and import nothing of
emulation, so schedules stay below emulation in the layering.

An expert task (X_*, E_*) is timed for the tokens its experts received in that (layer,
microbatch) (`ReceivedTokens`, from the Route), not for the plan's balanced share: the
zebra rank passes them with the task (`LoadedTiming`), so an emulated step includes the
routing's skew. A token transfer (D_*, C_*) likewise is told the rows each member sends each
member in that (layer, microbatch) (the route's `pair_rows`, the same on every member)."""
from __future__ import annotations

from typing import Callable

from megatron_hetermoe.parallel.extension import ReceivedTokens, TaskTiming
from megatron_hetermoe.plan.tasks import Task


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
