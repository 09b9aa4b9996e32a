"""What keeps an emulated rank's host delays small: a short GIL switch interval, garbage
collection only in post-step windows, and a raised priority where allowed."""
from __future__ import annotations

import gc
import sys
from typing import Callable

NICE_ENV = "HETERMOE_EMULATION_NICE"


def _set_niceness(value: int) -> None:
    """Set the niceness of every thread of this process (Linux keeps one per thread; threads
    started later inherit their creator's)."""
    import os

    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:
            pass


def _raise_priority() -> tuple[int, int] | None:
    """An emulated rank sleeps most of its time and must wake on time: give its threads a higher
    scheduling priority (niceness $HETERMOE_EMULATION_NICE, default -10; 0 or unset permission:
    unchanged), so that a wake-up preempts background work instead of queueing behind it.
    Returns (old, new) niceness, or None when unchanged."""
    import os

    try:
        target = int(os.environ.get(NICE_ENV, "-10"))
        old = os.getpriority(os.PRIO_PROCESS, 0)
    except (ValueError, OSError):
        return None
    if target >= old:
        return None
    try:
        _set_niceness(target)
    except (PermissionError, OSError):
        try:
            _set_niceness(old)
        except OSError:
            pass
        return None
    return old, target


def tune_process() -> tuple[tuple[int, int] | None, list[Callable[[], None]]]:
    """Make this process's host delays small for an emulated run: ((old, new) niceness or None,
    the functions that undo each change)."""
    restore: list[Callable[[], None]] = []
    # A thread woken by a collective or a timer waits for the GIL up to the switch interval
    # (5 ms by default): a host delay on every handoff between the stream threads and the
    # main thread. Emulated ranks hand over often; a short interval keeps those delays small.
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, 2e-4))
    restore.append(lambda: sys.setswitchinterval(old))
    # A full garbage collection of megatron's and torch's objects takes 0.1-1 s and would
    # land in some window at random: none during a step, one in each post-step window
    # (inside its budget), and the objects alive after the first step frozen out of it.
    if gc.isenabled():
        gc.disable()
        restore.append(gc.enable)
    niceness = _raise_priority()
    if niceness is not None:
        restore.append(lambda: _set_niceness(niceness[0]))
    return niceness, restore
