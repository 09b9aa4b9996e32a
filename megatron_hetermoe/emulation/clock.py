"""Emulated time's one primitive, shared by the emulator and the schedule executor: wait until
a deadline on time.perf_counter() (one system-wide monotonic clock on Linux, so every rank reads
the same time)."""
from __future__ import annotations

import time


def sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
