"""One run per --save directory: a lock held for the whole run.

Two runs saving into one directory would corrupt each other's history (each deletes the other's
in-progress `iter_N.tmp` as stale, and the tracker and manifests interleave). The run takes an
exclusive `flock` on SAVE/.hetermoe-save.lock before its first step and writes who holds it
(host, pid, start time, command); a second run is refused with that. The kernel drops a flock
when its holder dies, however it dies, so a crashed run leaves no stale lock (the file stays,
empty or naming the dead run, and is taken over).

On a file system whose flock does not reach other nodes (Lustre without `-o flock`, NFS without
a lock daemon: flock fails with ENOLCK/EOPNOTSUPP), the recorded holder decides instead: a live
pid on this host, or any holder on another host, keeps the directory locked; delete the file once
that run is over.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from megatron_hetermoe.checkpoint.format import CheckpointError
from megatron_hetermoe.outputs import writable_dir

LOCK_FILE = ".hetermoe-save.lock"


class SaveDirInUse(CheckpointError):
    """Another run holds the --save directory."""


def _holder_text(info: dict) -> str:
    return (f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('start')}"
            + (f": {info['command']}" if info.get("command") else ""))


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _alive_here(info: dict) -> bool:
    """Is the recorded holder a live process on this host (or on another host: assume so)?"""
    if not info.get("pid"):
        return False
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SaveLock:
    """The --save directory's lock; a context manager (`with SaveLock(path): ...`)."""

    def __init__(self, save_dir: str | os.PathLike, flag: str = "--save"):
        self.dir, self.flag = Path(save_dir), flag
        self.path = self.dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "SaveLock":
        writable_dir(self.flag, self.dir)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SaveDirInUse(
                f"{self.flag} {self.dir}: in use by another run ({_holder_text(_read_holder(self.path))}); two runs "
                f"saving into one directory corrupt its checkpoints: wait for that run to end, or save to "
                f"another directory") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            info = _read_holder(self.path)  # no flock here: the recorded holder decides
            if info.get("pid") != os.getpid() and _alive_here(info):
                os.close(fd)
                raise SaveDirInUse(
                    f"{self.flag} {self.dir}: in use by another run ({_holder_text(info)}; this file system has no "
                    f"flock, so the lock file {self.path} decides): wait for that run to end, save to another "
                    f"directory, or delete the lock file if that run is over") from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # free: no holder to name (the file stays, see the module doc)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SaveLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
