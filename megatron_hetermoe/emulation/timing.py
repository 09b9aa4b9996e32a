"""Task times of an emulated cluster, as the executors take them (schedules/timing.TaskTiming):
each compute task and transfer sleeps out its emulated duration from when it could start, and
its window goes to the rank's EmulationClock for the run's validity verdict."""
from __future__ import annotations

import time
from typing import Callable

from megatron_hetermoe.emulation.clock import sleep_until
from megatron_hetermoe.plan.tasks import Task


class EmulatedTiming:
    """`duration(task)`: the task's real seconds on the emulated GPU or link (emulated seconds x
    the clock's current scale). `clock` (an emulation.clock.EmulationClock) records every
    window and gives the step's origin; without one the origin is when this timing was made."""

    def __init__(self, duration: Callable[[Task], float], clock=None):
        self.duration, self.clock = duration, clock
        self._origin = time.perf_counter()

    def origin(self) -> float:
        return self.clock.t0 if self.clock is not None else self._origin

    def _window(self, lane: str, task: Task, start: float, real_end: float) -> float:
        budget = self.duration(task)
        sleep_until(start + budget)
        end = time.perf_counter()
        if self.clock is not None:
            self.clock.window(lane, task, start, budget, real_end, end)
        return end

    def compute(self, task: Task, start: float, real_end: float) -> float:
        return self._window("compute", task, start, real_end)

    def transfer(self, task: Task, start: float, real_end: float) -> float:
        return self._window(task.stream, task, start, real_end)
