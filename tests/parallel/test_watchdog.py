"""The launcher's watchdog names a stopped rank as the cause, whichever of its two clocks runs out first."""
import os
import signal
import subprocess
import sys
import time

from megatron_hetermoe.parallel.watchdog import Watchdog


def _sleepers(n):
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(n)]


def _write_report(d, rank, iteration, t):
    (d / f"progress.{rank}").write_text(f"{iteration} {t:.3f}\n")


def test_progress_timeout_first_still_names_the_stopped_rank(tmp_path):
    """The progress timeout counts from the last report, the stopped clock from the first check that saw the
    stop: with equal limits the progress timeout can run out first (CI saw it); the stopped rank is the cause."""
    procs = _sleepers(2)
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(0.2)
        old = time.time() - 10
        for r in range(2):
            _write_report(tmp_path, r, 1, old)
        wd = Watchdog(tmp_path, [p.pid for p in procs], progress_timeout_s=3)
        wd.start = old
        stall = wd.check()  # first check: the stop is new, the progress timeout long gone
        assert stall is not None and stall.rank == 1
        assert stall.message.startswith("rank 1 is stopped"), stall.message
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def test_no_stop_names_the_rank_furthest_behind(tmp_path):
    procs = _sleepers(2)
    try:
        old = time.time() - 10
        _write_report(tmp_path, 0, 2, old)
        _write_report(tmp_path, 1, 1, old)
        wd = Watchdog(tmp_path, [p.pid for p in procs], progress_timeout_s=3)
        wd.start = old
        stall = wd.check()
        assert stall is not None and stall.rank == 1 and "furthest behind" in stall.message, stall
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_recent_report_is_not_a_stall(tmp_path):
    procs = _sleepers(1)
    try:
        _write_report(tmp_path, 0, 1, time.time())
        assert Watchdog(tmp_path, [procs[0].pid], progress_timeout_s=3).check() is None
    finally:
        procs[0].kill()
        procs[0].wait()
