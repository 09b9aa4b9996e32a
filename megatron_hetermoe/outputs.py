"""The paths a command writes, checked before its work: a run must not train for an hour (or a
profile measure for minutes) and then fail to write its checkpoint, golden values, timeline,
TensorBoard scalars or profile.

A directory flag (--save, --timeline-dir, --tensorboard-dir) must name a directory or a path
that can be created as one, and a file must be creatable in it; a file flag
(--golden-values-out) must name a path in an existing, writable directory. Every refusal is an
OutputPathError naming the flag, the path and what is wrong. --save is also locked for the run
(checkpoint/lock.py).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from megatron_hetermoe.errors import UserError


class OutputPathError(UserError, ValueError):
    """A path the run would write to cannot be written."""


def _probe_write(flag: str, d: Path, what: str) -> None:
    """Create and remove a file in d: catches read-only mounts, permissions and full disks alike."""
    try:
        with tempfile.TemporaryFile(dir=d, prefix=".hetermoe-write-check-"):
            pass
    except OSError as e:
        raise OutputPathError(f"{flag} {what}: cannot write into {d} ({e.strerror}); give a writable "
                              f"directory") from None


def writable_dir(flag: str, path: str | os.PathLike) -> Path:
    """`path` as a directory this process can write into, created if missing."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise OutputPathError(f"{flag} {path}: is a file, not a directory; give a directory (it is created if "
                              f"missing)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{flag} {path}: cannot create the directory ({e.strerror}); give a writable "
                              f"directory") from None
    _probe_write(flag, d, str(path))
    return d


def writable_file(flag: str, path: str | os.PathLike) -> Path:
    """`path` as a file this process can create or replace; its directory must exist."""
    f = Path(path)
    if f.is_dir():
        raise OutputPathError(f"{flag} {path}: is a directory; give a file name (e.g. {Path(path) / 'out.json'})")
    parent = f.parent
    if not parent.is_dir():
        raise OutputPathError(f"{flag} {path}: the directory {parent} does not exist; create it first or give "
                              f"another path")
    _probe_write(flag, parent, str(path))
    return f


def check_output_paths(a: argparse.Namespace) -> None:
    """Every path a `hetermoe train` / `pretrain` run writes, except --save (SaveLock checks it)."""
    for flag, path in (("--tensorboard-dir", a.tensorboard_dir), ("--timeline-dir", getattr(a, "timeline_dir", None))):
        if path:
            writable_dir(flag, path)
    if getattr(a, "golden_values_out", None):
        writable_file("--golden-values-out", a.golden_values_out)
