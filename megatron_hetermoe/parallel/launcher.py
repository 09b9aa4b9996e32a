"""Start N CPU ranks over gloo, for tests and tools (CPU ranks on a GPU host too).

Ranks are forked from the parent after it imported megatron (an import costs ~3.5 s per process
otherwise). A failing rank's traceback is shown, and nothing hangs: the parent watches every
child, and as soon as one dies (exception, signal, os._exit) it kills the rest and raises
LaunchError naming the rank and its error. Collectives also carry a gloo timeout so a rank
blocked on a dead peer gives up on its own.

No rank outlives its launcher: SIGTERM (or SIGHUP) to the parent kills every rank and raises
errors.Terminated; if the parent dies without a word (SIGKILL), each rank dies with it
(PR_SET_PDEATHSIG on Linux, and a thread watching the parent's pid elsewhere), and a janitor
process removes the run directory. A job may run as long as it makes progress: instead of a
wall-clock limit (`timeout_s`, off for training runs) the parent's watchdog (watchdog.py) ends a
job whose ranks stopped reporting progress, or one of whose ranks was stopped, naming that rank.

A rank's user error (errors.UserError: a refused checkpoint, data file, ...) reaches the user as
one line (LaunchError.user_message, `rank N: message`); anything else with its traceback.

Output a person can read: each warning (megatron's "Apex is not installed. Falling back to Torch
Norm", deprecations) is shown once per job, not once per rank (show_warnings_once), and only rank
0 writes to stdout (HETERMOE_ALL_RANKS_OUTPUT=1 lets every rank write, for debugging).
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class LaunchError(RuntimeError):
    """A rank failed or the job stopped making progress; the message holds the rank's traceback.
    `user_message` is `rank N: message` when the rank failed on a user's error (errors.UserError),
    None for a bug."""

    def __init__(self, message: str, rank: int | None = None, peer_exit_s: dict[int, float] | None = None,
                 killed: list[int] | None = None, user_message: str | None = None, lost: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        # Ranks that ended without a report of their own (a signal, os._exit, an OOM kill): the
        # process, and under a real job its GPU, is gone; their peers only report losing them.
        self.lost = lost or []
        # With peer_grace_s: seconds after the failure at which each other rank exited by itself,
        # and the ranks still running when the grace ran out (then killed).
        self.peer_exit_s = peer_exit_s or {}
        self.killed = killed or []
        self.user_message = user_message


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    timeout_s: float | None = 300.0  # whole job; None: no limit (the progress watchdog decides)
    collective_timeout_s: float = 60.0  # one gloo collective
    threads_per_rank: int = 1
    progress_timeout_s: float | None = None  # watchdog.py; None: only stopped ranks are caught


def collective_timeout() -> datetime.timedelta:
    """The gloo timeout of this job's collectives; pass it to every gloo new_group (NCCL's is
    device.group_timeout's)."""
    return datetime.timedelta(seconds=float(os.environ.get("HETERMOE_COLLECTIVE_TIMEOUT_S", "60")))


# ---------------------------------------------------------------- each warning once per job
# Every rank runs the same code, so each would print the same warnings, and Python's own
# once-per-location registry is reset whenever a warnings filter changes. Instead a warning is
# keyed by its category and text: a process shows a key once; forked ranks inherit what their
# parent showed and share a directory of markers (created exclusively, so among the ranks only
# the first shows it); after the job the parent learns what its ranks showed, so the next job of
# the same command stays quiet too. Logged warnings (logging.WARNING and up) go the same way.
_shown: set[str] = set()
_marker_dir: str | None = None
_orig_showwarning: Callable | None = None
ALL_RANKS_OUTPUT_ENV = "HETERMOE_ALL_RANKS_OUTPUT"


def _key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:20]


def first_time(text: str) -> bool:
    """True the first time this job meets `text` (in any of its processes), False after."""
    k = _key(text)
    if k in _shown:
        return False
    _shown.add(k)
    if _marker_dir is not None:
        try:
            os.close(os.open(os.path.join(_marker_dir, k), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False  # a sibling rank showed it
        except OSError:
            pass  # the directory is gone (job over): show rather than lose it
    return True


def _showwarning_once(message, category, filename, lineno, file=None, line=None):
    if first_time(f"{category.__name__}: {message}"):
        (_orig_showwarning or warnings._showwarning_orig)(message, category, filename, lineno, file, line)


class _LogOnce(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        # One verdict per record, kept on it: every handler this filter sits on gets the record or
        # none does (asked per handler, the first would take the "first time" from the others).
        first = getattr(record, "_hetermoe_first_time", None)
        if first is None:
            first = record._hetermoe_first_time = first_time(f"{record.levelname}: {record.getMessage()}")
        return first


_log_once = _LogOnce()


def show_warnings_once() -> None:
    """Route this process's warnings (and logged warnings) through the once-per-job filter.
    Idempotent; `launch` calls it, and `hetermoe` calls it before running a command."""
    global _orig_showwarning
    if warnings.showwarning is not _showwarning_once:
        _orig_showwarning = warnings.showwarning
        warnings.showwarning = _showwarning_once
    # What this process showed before (e.g. megatron's import-time warnings): Python's
    # per-module registries hold (text, category, lineno) for each warning already shown.
    for mod in list(sys.modules.values()):
        reg = getattr(mod, "__warningregistry__", None)
        if isinstance(reg, dict):
            for k in reg:
                if isinstance(k, tuple) and len(k) == 3 and isinstance(k[1], type):
                    _shown.add(_key(f"{k[1].__name__}: {k[0]}"))
    for h in [logging.lastResort, *logging.getLogger().handlers]:
        if h is not None and _log_once not in h.filters:
            h.addFilter(_log_once)


def _quiet_stdout() -> None:
    """Send this process's stdout (Python's and the C runtime's) to /dev/null."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


# ---------------------------------------------------------------- no rank outlives the launcher
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """End this process when `parent_pid` (the launcher) dies, however it dies: the kernel's
    parent-death signal on Linux, and a thread that polls the parent's pid as a fallback (other
    systems, or a prctl that failed)."""
    with suppress(OSError, AttributeError):  # no libc prctl (not Linux): the thread below does it
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="hetermoe-parent-watch", daemon=True).start()


def _janitor(run_dir: str, parent_pid: int) -> None:
    """A small forked process that removes the run directory if the launcher dies without its
    `finally` (SIGKILL, an OOM kill); the launcher kills it at the end of a normal run."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # hold no pipe of the caller open (`hetermoe ... | cat` must end)
        os.dup2(devnull, fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a signal to the group is the launcher's to handle
        signal.signal(sig, signal.SIG_IGN)
    while os.getppid() == parent_pid:
        time.sleep(0.25)
    time.sleep(0.5)  # the ranks die with the parent (PR_SET_PDEATHSIG); let the kernel reap them
    shutil.rmtree(run_dir, ignore_errors=True)
    os._exit(0)


@contextmanager
def _terminate_on_signals():
    """In the main thread: SIGTERM / SIGHUP raise errors.Terminated (so `launch` kills its ranks
    on the way out) where the signal would otherwise kill the process outright."""
    from megatron_hetermoe.errors import Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:  # nohup's SIG_IGN and a caller's own handler stay
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _end_multiprocessing_children() -> None:
    """What a normal exit would do for multiprocessing in this rank, which os._exit skips: shut
    down its managers and child processes (megatron-core's dist_checkpointing starts a spawned
    Manager, whose server holds the caller's stdout open) and remove its pymp-* temp directory."""
    import multiprocessing.util

    with suppress(Exception):  # best effort on the way out (multiprocessing's own exit steps)
        multiprocessing.util._run_finalizers(0)  # managers and pools shut down
        for p in mp.active_children():  # anything else the rank started: not waited for
            p.kill()
            p.join(1)
        multiprocessing.util._run_finalizers()  # the rest, its pymp-* directory included


def _child(rank: int, cfg: LaunchConfig, store_path: str, out_dir: str, fn: Callable, args: tuple,
           parent_pid: int) -> None:
    global _marker_dir
    _die_with_parent(parent_pid)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the parent's handlers (see _terminate_on_signals) are not a rank's
        signal.signal(sig, signal.SIG_DFL)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU rank, even on a GPU host
    _marker_dir = os.path.join(out_dir, "warned")
    if rank != 0 and os.environ.get(ALL_RANKS_OUTPUT_ENV, "") in ("", "0"):
        _quiet_stdout()  # routine output comes from rank 0; errors reach the parent below

    import torch
    import torch.distributed as dist

    from megatron_hetermoe.errors import UserError
    from megatron_hetermoe.parallel import cpu_backend
    from megatron_hetermoe.parallel.watchdog import PROGRESS_DIR_ENV, report

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(cfg.threads_per_rank),
                      HETERMOE_COLLECTIVE_TIMEOUT_S=str(cfg.collective_timeout_s))
    os.environ[PROGRESS_DIR_ENV] = out_dir
    torch.set_num_threads(cfg.threads_per_rank)
    code = 0
    try:
        report(0)  # started: the watchdog's clock for this rank
        cpu_backend.apply(force=True)
        store = dist.FileStore(store_path, cfg.world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size,
                                timeout=collective_timeout())
        # gloo connects its mesh pair by pair: a rank done with its own pairs could run fn and exit
        # while a peer still connects to it ("Connection closed by peer" there). No rank goes on
        # before every rank's mesh is up.
        dist.barrier()
        result = fn(rank, cfg.world_size, *args)
        with open(Path(out_dir) / f"result.{rank}", "wb") as f:
            pickle.dump(result, f)
        # The same race on the way out: fn may have made groups (dist.new_group connects them
        # pair by pair too), and a rank done with its pairs must not exit under a peer still
        # connecting to it.
        if dist.is_initialized():
            dist.barrier()
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        # First line: when it failed, so the parent can tell the first failure (the cause)
        # from the peers that failed after it (connection closed by the dead rank).
        (Path(out_dir) / f"error.{rank}").write_text(
            f"{time.time():.6f}\n{type(e).__name__}: {e}\n\n" + traceback.format_exc()
        )
        if isinstance(e, UserError):  # its message names the input and the fix: one line for the user
            (Path(out_dir) / f"user_error.{rank}").write_text(str(e))
        code = 1
    finally:
        _end_multiprocessing_children()
        # Skip destroy_process_group and atexit handlers: peers may be dead, and a forked
        # child must not run the parent's exit hooks.
        os._exit(code)


_TIMEOUT_WORDS = ("Timed out", "timed out", "Timeout", "timeout")


def _first_failure(tmp: str, procs: list, grace_s: float = 1.0, stopped: list[int] | None = None) -> int:
    """The rank whose failure came first. Peers of a dead rank fail soon after it, so wait a
    moment for everyone's reports. A rank that died without a report (a signal, os._exit, an OOM
    kill) is the cause: its peers only report losing it. So is a stopped rank (SIGSTOP), or one
    still running without a report when the first report is a collective timeout: its peers
    timed out waiting for it. Otherwise the earliest report wins."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.02)
    stamps, texts = {}, {}
    for r in range(len(procs)):
        f = Path(tmp) / f"error.{r}"
        if f.exists():
            try:
                head, texts[r] = f.read_text().split("\n", 1)
                stamps[r] = float(head)
            except ValueError:
                pass
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in stamps]
    if silent:
        return silent[0]
    if stopped:
        return stopped[0]
    first = min(stamps, key=stamps.get)
    if any(w in texts[first].split("\n\n", 1)[0] for w in _TIMEOUT_WORDS):
        running = [r for r, p in enumerate(procs) if p.exitcode is None and r not in stamps]
        if running:
            return running[0]
    return first


def _rank_failure(tmp: str, rank: int, procs: list, world_size: int, exit_at: dict, killed: list,
                  stall: str | None, lost: list[int] | None = None) -> LaunchError:
    err = Path(tmp) / f"error.{rank}"
    code = procs[rank].exitcode
    if stall is not None:
        detail = stall
    elif err.exists():
        detail = err.read_text().split("\n", 1)[1]
    else:
        detail = (f"exited with {'signal ' + str(-code) if code < 0 else 'code ' + str(code)} without a Python "
                  f"traceback")
    user = Path(tmp) / f"user_error.{rank}"
    line = f"rank {rank}: {user.read_text()}" if user.exists() and stall is None else None
    if stall is not None:
        line = stall
    return LaunchError(f"rank {rank} of {world_size} failed: {detail}", rank=rank, peer_exit_s=exit_at,
                       killed=killed, user_message=line, lost=lost)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = 300.0,
           collective_timeout_s: float = 60.0, peer_grace_s: float = 0.0,
           progress_timeout_s: float | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` forked gloo ranks; return their results.

    fn and its results must be picklable only for the results (fork shares fn itself).
    Raises LaunchError when a rank fails, the job exceeds timeout_s (None: no limit), a rank is
    stopped, or no rank reports progress for progress_timeout_s (watchdog.py; None: not
    checked). peer_grace_s > 0 leaves the other ranks up to that long to notice the failure and
    exit by themselves (as they must under torchrun or SLURM, where no parent kills them) before
    they are killed; LaunchError then tells when each exited. SIGTERM/SIGHUP to this process
    kill every rank and raise errors.Terminated.
    """
    import torch

    from megatron_hetermoe.parallel import cpu_backend
    from megatron_hetermoe.parallel.watchdog import (
        Watchdog,
        describe_state,
        process_state,
    )

    if world_size < 1:
        raise ValueError(f"world_size={world_size}: start at least 1 rank")
    if torch.backends.cuda.is_built():
        # The parent may use a GPU, and asking it about CUDA would poison fork: each rank
        # patches itself (_child).
        cpu_backend.preload()
    else:
        cpu_backend.apply()  # in the parent, so children inherit it
    show_warnings_once()  # after megatron's import: what it showed there counts as shown
    cfg = LaunchConfig(world_size, timeout_s, collective_timeout_s, progress_timeout_s=progress_timeout_s)
    ctx = mp.get_context("fork")
    me = os.getpid()
    with tempfile.TemporaryDirectory(prefix="hetermoe-launch-") as tmp, _terminate_on_signals():
        store_path = os.path.join(tmp, "store")
        os.mkdir(os.path.join(tmp, "warned"))
        # Unwritten output in the parent's buffers would be written again by every child.
        sys.stdout.flush()
        sys.stderr.flush()
        janitor = ctx.Process(target=_janitor, args=(tmp, me), daemon=False)
        procs = [ctx.Process(target=_child, args=(r, cfg, store_path, tmp, fn, args, me), daemon=False)
                 for r in range(world_size)]
        failed: int | None = None
        stall: str | None = None
        lost: list[int] = []
        try:
            janitor.start()
            for p in procs:
                p.start()
            dog = Watchdog(tmp, [p.pid for p in procs], progress_timeout_s)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            next_check = time.monotonic() + 0.5
            while True:
                codes = [p.exitcode for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = _first_failure(tmp, procs, stopped=dog.stopped())
                    if procs[failed].exitcode is None and not (Path(tmp) / f"error.{failed}").exists():
                        # Alive without an error of its own: its peers timed out waiting for it.
                        stall = (f"rank {failed} made no progress ({describe_state(process_state(procs[failed].pid))})"
                                 f" while its peers timed out waiting for it")
                    t_fail = time.monotonic()
                    exit_at: dict[int, float] = {}
                    while time.monotonic() - t_fail < peer_grace_s:
                        for r, p in enumerate(procs):
                            if r != failed and r not in exit_at and p.exitcode is not None:
                                exit_at[r] = time.monotonic() - t_fail
                        if len(exit_at) == world_size - 1:
                            break
                        time.sleep(0.02)
                    killed = [r for r, p in enumerate(procs) if r != failed and p.exitcode is None]
                    lost = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                            and not (Path(tmp) / f"error.{r}").exists()]
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + 0.5
                    found = dog.check()
                    if found is not None:
                        failed, stall, exit_at = found.rank, found.message, {}
                        killed = [r for r, p in enumerate(procs) if p.exitcode is None]
                        break
                if deadline is not None and time.monotonic() > deadline:
                    running = [r for r, c in enumerate(codes) if c is None]
                    raise LaunchError(
                        f"job of {world_size} ranks exceeded {timeout_s:.0f} s; ranks {running} were "
                        f"still running (a hang or a too-small timeout_s)"
                    )
                time.sleep(0.02)
        finally:
            for p in [*procs, janitor]:
                if p.pid is not None and p.exitcode is None:
                    try:
                        os.kill(p.pid, signal.SIGKILL)  # a stopped (SIGSTOP) rank too
                    except ProcessLookupError:
                        pass
            for p in [*procs, janitor]:
                if p.pid is not None:
                    p.join()
            _shown.update(os.listdir(os.path.join(tmp, "warned")))  # what the ranks showed
        if failed is not None:
            raise _rank_failure(tmp, failed, procs, world_size, exit_at, killed, stall, lost)
        out = []
        for r in range(world_size):
            with open(Path(tmp) / f"result.{r}", "rb") as f:
                out.append(pickle.load(f))
        return out
