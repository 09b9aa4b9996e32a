"""The executors' seam for time: how long a task takes on the machine a run stands for.

Without a `TaskTiming` a task takes as long as it runs. An emulated cluster (emulation/) passes
one that stretches every compute task and transfer to the emulated time: each starts when the
simulator says it could (the previous task ended and its input arrived; a transfer: when its
last member could start it), runs its real work, then sleeps out its emulated duration, and the
window is recorded for the run's validity verdict. The executors call it and import nothing of
emulation, so schedules stay below emulation in the layering."""
from __future__ import annotations

from typing import Protocol

from megatron_hetermoe.plan.tasks import Task


class TaskTiming(Protocol):
    def origin(self) -> float:
        """The step's time origin (time.perf_counter seconds): when its first task could start."""

    def compute(self, task: Task, start: float, real_end: float) -> float:
        """A compute task that could start at `start` and whose real work ended at `real_end`:
        wait until its emulated end, record its window; return when it ended."""

    def transfer(self, task: Task, start: float, real_end: float) -> float:
        """The same for a transfer, `start` being when its last member could start it (the
        executors exchange that with the transfer's route: TokenRoute.latest)."""
