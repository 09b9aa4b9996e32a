"""Is every rank of a forked job still making progress? The launcher's watchdog, instead of a
wall-clock limit on the job.

Ranks report progress (`report(iteration)`: the training loop after each step, around each
checkpoint save): the launcher gives each rank a file in its run directory
($HETERMOE_PROGRESS_DIR) and the rank rewrites it in place (iteration, time). The launcher reads
them (`Watchdog.check`) and ends the job, naming the rank, when

- a rank is stopped (process state T: SIGSTOP, a debugger) for `stopped_after_s`: its peers would
  otherwise wait for it until their collective timeout and be blamed for it, or
- no rank reported anything for `progress_timeout_s` (`--progress-timeout`): a hang. The rank
  named is the one furthest behind (lowest iteration, then not running, then the oldest report).

A run may take any time as long as it keeps reporting. Under torchrun or SLURM (no launcher
parent) `report` does nothing: there the collective timeouts (NCCL's watchdog) catch hangs.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROGRESS_DIR_ENV = "HETERMOE_PROGRESS_DIR"
DEFAULT_PROGRESS_TIMEOUT_S = 600.0  # as NCCL's default collective timeout: a step longer than that is a hang
STOPPED_AFTER_S = 10.0
_RECORD = 48  # bytes of one progress record: "iteration time", padded, rewritten in place

_fd: int | None = None
_fd_pid: int | None = None


def report(iteration: int) -> None:
    """This rank made progress (reached `iteration`, or finished a part of it). Cheap: one pwrite."""
    global _fd, _fd_pid
    d = os.environ.get(PROGRESS_DIR_ENV)
    if not d:
        return
    if _fd_pid != os.getpid():  # first report of this process (a forked rank inherits no fd)
        _fd = os.open(os.path.join(d, f"progress.{os.environ.get('RANK', '0')}"), os.O_WRONLY | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    os.pwrite(_fd, f"{iteration} {time.time():.3f}".ljust(_RECORD - 1).encode() + b"\n", 0)


def read_report(d: str | os.PathLike, rank: int) -> tuple[int, float] | None:
    """(iteration, time) of a rank's last report, None before its first."""
    try:
        it, t = (Path(d) / f"progress.{rank}").read_text().split()
        return int(it), float(t)
    except (OSError, ValueError):
        return None


_STATES = {"R": "running", "S": "waiting", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP?)",
           "t": "stopped by a debugger", "Z": "exited (zombie)"}


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]  # the command name may hold spaces


def describe_state(state: str | None) -> str:
    return _STATES.get(state or "", f"state {state}" if state else "state unknown")


@dataclass
class Stall:
    rank: int
    message: str


class Watchdog:
    """The launcher's view of its ranks' progress (see the module doc)."""

    def __init__(self, run_dir: str | os.PathLike, pids: list[int], progress_timeout_s: float | None,
                 stopped_after_s: float = STOPPED_AFTER_S):
        self.dir, self.pids = run_dir, pids
        self.progress_timeout_s = progress_timeout_s or None
        self.stopped_after_s = min(stopped_after_s, self.progress_timeout_s or stopped_after_s)
        self.start = time.time()
        self._stopped_since: dict[int, float] = {}

    def stopped(self) -> list[int]:
        """Ranks stopped right now (SIGSTOP, a debugger)."""
        return [r for r, pid in enumerate(self.pids) if process_state(pid) in ("T", "t")]

    def check(self) -> Stall | None:
        now = time.time()
        stopped = set(self.stopped())
        for r in list(self._stopped_since):
            if r not in stopped:
                del self._stopped_since[r]
        for r in sorted(stopped):
            self._stopped_since.setdefault(r, now)

        def stopped_stall(r: int) -> Stall:
            return Stall(r, f"rank {r} is {describe_state(process_state(self.pids[r]))} and made no progress "
                            f"for {now - self._stopped_since[r]:.0f} s; its peers wait for it (resume it with "
                            f"SIGCONT, or find who stopped it)")

        for r in sorted(stopped):
            if now - self._stopped_since[r] >= self.stopped_after_s:
                return stopped_stall(r)
        if self.progress_timeout_s is None:
            return None
        reports = [read_report(self.dir, r) for r in range(len(self.pids))]
        last = max((t for _, t in filter(None, reports)), default=self.start)
        if now - max(last, self.start) < self.progress_timeout_s:
            return None
        if stopped:  # the progress timeout ran out first (it counts from the last report): a stopped rank is the cause
            return stopped_stall(min(stopped))
        states = [process_state(pid) for pid in self.pids]

        def behind(r: int):  # lowest iteration, then not waiting in a collective, then oldest report
            it, t = reports[r] or (-1, self.start)
            return it, states[r] in ("S", None), t

        r = min(range(len(self.pids)), key=behind)
        where = {r2: ("no report yet" if rep is None else f"iteration {rep[0]}") for r2, rep in enumerate(reports)}
        others = ", ".join(f"rank {r2}: {w}, {describe_state(states[r2])}" for r2, w in where.items())
        return Stall(r, f"no rank made progress for {now - max(last, self.start):.0f} s (--progress-timeout "
                        f"{self.progress_timeout_s:g}); rank {r} is furthest behind ({others}); a hang, or a step "
                        f"longer than the timeout (raise --progress-timeout)")
