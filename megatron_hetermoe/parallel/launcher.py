"""Start N CPU ranks over gloo, for tests and tools (CPU ranks on a GPU host too).

Ranks are forked from the parent after it imported megatron (an import costs ~3.5 s per process
otherwise). A failing rank's traceback is shown, and nothing hangs: the parent watches every
child, and as soon as one dies (exception, signal, os._exit) or the deadline passes it kills the
rest and raises LaunchError naming the rank and its error. Collectives also carry a gloo timeout
so a rank blocked on a dead peer gives up on its own.

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
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class LaunchError(RuntimeError):
    """A rank failed or the job ran out of time; the message holds the rank's traceback."""

    def __init__(self, message: str, rank: int | None = None, peer_exit_s: dict[int, float] | None = None,
                 killed: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        # With peer_grace_s: seconds after the failure at which each other rank exited by itself,
        # and the ranks still running when the grace ran out (then killed).
        self.peer_exit_s = peer_exit_s or {}
        self.killed = killed or []


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    timeout_s: float = 300.0  # whole job
    collective_timeout_s: float = 60.0  # one gloo collective
    threads_per_rank: int = 1


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
        return record.levelno < logging.WARNING or first_time(f"{record.levelname}: {record.getMessage()}")


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


def _child(rank: int, cfg: LaunchConfig, store_path: str, out_dir: str, fn: Callable, args: tuple) -> None:
    global _marker_dir
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU rank, even on a GPU host
    _marker_dir = os.path.join(out_dir, "warned")
    if rank != 0 and os.environ.get(ALL_RANKS_OUTPUT_ENV, "") in ("", "0"):
        _quiet_stdout()  # routine output comes from rank 0; errors reach the parent below

    import torch
    import torch.distributed as dist

    from megatron_hetermoe.parallel import cpu_backend

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(cfg.threads_per_rank),
                      HETERMOE_COLLECTIVE_TIMEOUT_S=str(cfg.collective_timeout_s))
    torch.set_num_threads(cfg.threads_per_rank)
    code = 0
    try:
        cpu_backend.apply(force=True)
        store = dist.FileStore(store_path, cfg.world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size,
                                timeout=collective_timeout())
        result = fn(rank, cfg.world_size, *args)
        with open(Path(out_dir) / f"result.{rank}", "wb") as f:
            pickle.dump(result, f)
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        # First line: when it failed, so the parent can tell the first failure (the cause)
        # from the peers that failed after it (connection closed by the dead rank).
        (Path(out_dir) / f"error.{rank}").write_text(
            f"{time.time():.6f}\n{type(e).__name__}: {e}\n\n" + traceback.format_exc()
        )
        code = 1
    finally:
        # Skip destroy_process_group and atexit handlers: peers may be dead, and a forked
        # child must not run the parent's exit hooks.
        os._exit(code)


def _first_failure(tmp: str, procs: list, grace_s: float = 1.0) -> int:
    """The rank whose failure came first. Peers of a dead rank fail soon after it, so wait a
    moment for everyone's reports. A rank that died without a report (a signal, os._exit, an OOM
    kill) is the cause: its peers only report losing it. Otherwise the earliest report wins."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.02)
    stamps = {}
    for r in range(len(procs)):
        f = Path(tmp) / f"error.{r}"
        if f.exists():
            try:
                stamps[r] = float(f.read_text().split("\n", 1)[0])
            except ValueError:
                pass
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in stamps]
    if silent:
        return silent[0]
    return min(stamps, key=stamps.get)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
           collective_timeout_s: float = 60.0, peer_grace_s: float = 0.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` forked gloo ranks; return their results.

    fn and its results must be picklable only for the results (fork shares fn itself).
    Raises LaunchError when a rank fails or the job exceeds timeout_s. peer_grace_s > 0 leaves
    the other ranks up to that long to notice the failure and exit by themselves (as they must
    under torchrun or SLURM, where no parent kills them) before they are killed; LaunchError
    then tells when each exited.
    """
    import torch

    from megatron_hetermoe.parallel import cpu_backend

    if torch.backends.cuda.is_built():
        # The parent may use a GPU, and asking it about CUDA would poison fork: each rank
        # patches itself (_child).
        cpu_backend.preload()
    else:
        cpu_backend.apply()  # in the parent, so children inherit it
    show_warnings_once()  # after megatron's import: what it showed there counts as shown
    cfg = LaunchConfig(world_size, timeout_s, collective_timeout_s)
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="hetermoe-launch-") as tmp:
        store_path = os.path.join(tmp, "store")
        os.mkdir(os.path.join(tmp, "warned"))
        procs = [ctx.Process(target=_child, args=(r, cfg, store_path, tmp, fn, args), daemon=False)
                 for r in range(world_size)]
        # Unwritten output in the parent's buffers would be written again by every child.
        sys.stdout.flush()
        sys.stderr.flush()
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed: int | None = None
        try:
            while True:
                codes = [p.exitcode for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = _first_failure(tmp, procs)
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
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    running = [r for r, c in enumerate(codes) if c is None]
                    raise LaunchError(
                        f"job of {world_size} ranks exceeded {timeout_s:.0f} s; ranks {running} were "
                        f"still running (a hang or a too-small timeout_s)"
                    )
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join()
            _shown.update(os.listdir(os.path.join(tmp, "warned")))  # what the ranks showed
        if failed is not None:
            err = Path(tmp) / f"error.{failed}"
            code = procs[failed].exitcode
            detail = err.read_text().split("\n", 1)[1] if err.exists() else (
                f"exited with {'signal ' + str(-code) if code < 0 else 'code ' + str(code)} "
                f"without a Python traceback")
            raise LaunchError(f"rank {failed} of {world_size} failed: {detail}", rank=failed,
                              peer_exit_s=exit_at, killed=killed)
        out = []
        for r in range(world_size):
            with open(Path(tmp) / f"result.{r}", "rb") as f:
                out.append(pickle.load(f))
        return out
