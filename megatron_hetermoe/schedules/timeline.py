"""A rank's timeline: every compute task and transfer it runs, as (lane, kind, layer,
microbatch, start, end, clock). Lane "compute" holds A/X/E tasks, "dispatch" and "combine" the
two transfer streams. Times are seconds of time.perf_counter(), which on Linux is one
system-wide monotonic clock, so the ranks of a job on one host share a time axis.

`clock` says what a span measures:
* "host": when the issuing thread ran the task (time.perf_counter() around it). On a CPU rank
  that is when the work ran; on a CUDA rank it is when the work was enqueued (a transfer's end:
  when it was issued), not when it ran. Emulated runs (--emulate) are host-timed on purpose.
* "cuda": when the work ran on the GPU, from a pair of CUDA events (enable_timing) recorded on
  the stream the work was enqueued to, converted to the host axis once per step
  (schedules/executor.py `CudaTiming`). A CUDA rank running a task list records both clocks.
Megatron's own schedule on attention ranks (DistEP without emulation, and the Megatron EP
trainer) runs no task list and records nothing. `busy` prefers the "cuda" spans of a step.
tools/timeline.py draws the timeline, labelling each row with its clock.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    rank: int
    role: str
    lane: str
    kind: str
    layer: int
    microbatch: int
    start: float
    end: float
    step: int = 0
    clock: str = "host"  # "host" or "cuda" (module docstring); files written before it: "host"


CLOCKS = ("host", "cuda")


class TimelineRecorder:
    """Thread-safe event list of one rank (the stream threads record too). With keep_history
    (a run writing its timeline) every step's events are kept; without, only the current step's
    (what per-step utilization reads), so memory and busy() stay flat over a long run."""

    def __init__(self, rank: int, role: str, keep_history: bool = True):
        self.rank, self.role, self.keep_history = rank, role, keep_history
        self.events: list[Event] = []
        self._step = 0
        self._lock = threading.Lock()

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        with self._lock:
            self._step = step
            if not self.keep_history:
                self.events = [e for e in self.events if e.step >= step]

    def record(self, lane: str, kind: str, layer: int, microbatch: int, start: float, end: float,
               clock: str = "host") -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r}; use one of {CLOCKS}")
        with self._lock:
            self.events.append(Event(self.rank, self.role, lane, kind, layer, microbatch, start, end, self._step,
                                     clock))

    def busy(self, step: int) -> float:
        """Seconds spent in compute tasks during `step`: on the GPU when the step has "cuda"
        spans (a CUDA rank's task list), else on the host clock."""
        with self._lock:
            mine = [e for e in self.events if e.step == step and e.lane == "compute"]
        clock = "cuda" if any(e.clock == "cuda" for e in mine) else "host"
        return sum(e.end - e.start for e in mine if e.clock == clock)

    def kind_seconds(self, step: int) -> dict[str, float]:
        """Seconds per compute task kind during `step`, on the clock busy() reads."""
        with self._lock:
            mine = [e for e in self.events if e.step == step and e.lane == "compute"]
        clock = "cuda" if any(e.clock == "cuda" for e in mine) else "host"
        out: dict[str, float] = {}
        for e in mine:
            if e.clock == clock:
                out[e.kind] = out.get(e.kind, 0.0) + (e.end - e.start)
        return out

    def save(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / f"timeline.rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(e) for e in self.events]))
        return path


def load_events(run_dir: str | Path) -> list[Event]:
    files = sorted(Path(run_dir).glob("timeline.rank*.json"))
    if not files:
        raise FileNotFoundError(f"no timeline.rank*.json in {run_dir}; train with a run directory first")
    return [Event(**e) for f in files for e in json.loads(f.read_text())]
