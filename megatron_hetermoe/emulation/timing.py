"""Task times of an emulated cluster, as the executors take them (schedules/timing.TaskTiming):
each compute task and transfer sleeps out its emulated duration from when it could start, and
its window goes to the rank's EmulationClock for the run's validity verdict. An expert task told
what its experts received (schedules/timing.ReceivedTokens) lasts the cost model's time for those
tokens (`expert_duration`), not the plan's balanced share; a token transfer told the rows each
member sent each member lasts the collective's time for those rows (`transfer_duration`)."""
from __future__ import annotations

import time
from typing import Callable

from megatron_hetermoe.emulation.clock import sleep_until
from megatron_hetermoe.parallel.extension import ReceivedTokens
from megatron_hetermoe.plan.tasks import Task


class EmulatedTiming:
    """`duration(task)`: the task's real seconds on the emulated GPU or link (emulated seconds x
    the clock's current scale). `clock` (an emulation.clock.EmulationClock) records every
    window and gives the step's origin; without one the origin is when this timing was made.
    `expert_duration(task, tokens)`: the real seconds of an expert task whose experts received
    `tokens` (None: every task lasts duration(task)); `transfer_duration(task, rows)` likewise for a
    token transfer of those rows between the members."""

    def __init__(self, duration: Callable[[Task], float], clock=None,
                 expert_duration: Callable[[Task, ReceivedTokens], float] | None = None,
                 transfer_duration: Callable[[Task, tuple], float] | None = None):
        self.duration, self.clock, self.expert_duration = duration, clock, expert_duration
        self.transfer_duration = transfer_duration
        self._origin = time.perf_counter()

    def origin(self) -> float:
        return self.clock.t0 if self.clock is not None else self._origin

    def _window(self, lane: str, task: Task, start: float, real_end: float,
                tokens: ReceivedTokens | None = None, rows: tuple | None = None) -> float:
        if tokens is not None and self.expert_duration is not None:
            budget = self.expert_duration(task, tokens)
        elif rows and self.transfer_duration is not None:
            budget = self.transfer_duration(task, rows)
        else:
            budget = self.duration(task)
        sleep_until(start + budget)
        end = time.perf_counter()
        if self.clock is not None:
            self.clock.window(lane, task, start, budget, real_end, end)
        return end

    def compute(self, task: Task, start: float, real_end: float, tokens: ReceivedTokens | None = None) -> float:
        return self._window("compute", task, start, real_end, tokens)

    def transfer(self, task: Task, start: float, real_end: float, rows: tuple | None = None) -> float:
        return self._window(task.stream, task, start, real_end, rows=rows)
