"""A rank's timeline: every compute task and transfer it runs, as (lane, kind, layer,
microbatch, start, end). Lane "compute" holds A/X/E tasks, "dispatch" and "combine" the two
transfer streams. Times come from time.perf_counter(), which on Linux is one system-wide
monotonic clock, so the ranks of a CPU job share a time axis (on CUDA the transfer lanes record
when a transfer was issued: schedules/executor.py). tools/timeline.py draws it.
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


class TimelineRecorder:
    """Thread-safe event list of one rank (the stream threads record too)."""

    def __init__(self, rank: int, role: str):
        self.rank, self.role = rank, role
        self.events: list[Event] = []
        self.step = 0
        self._lock = threading.Lock()

    def record(self, lane: str, kind: str, layer: int, microbatch: int, start: float, end: float) -> None:
        with self._lock:
            self.events.append(Event(self.rank, self.role, lane, kind, layer, microbatch, start, end, self.step))

    def busy(self, step: int) -> float:
        """Seconds spent in compute tasks during `step`."""
        return sum(e.end - e.start for e in self.events if e.step == step and e.lane == "compute")

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
