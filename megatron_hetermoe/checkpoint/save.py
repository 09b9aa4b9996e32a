"""Saving a checkpoint: every rank writes its file, rank 0 writes the manifest and publishes the
iteration (rename iter_N.tmp to iter_N, then the tracker); write_offline does the same from one
process (`hetermoe checkpoint import`). FAULT_HOOK lets tests crash a save between the steps.

Atomic: ranks write into SAVE/iter_N.tmp/, rank 0 writes the manifest there, renames the
directory to iter_N and only then rewrites the tracker (temp file + rename). A crash at any
point leaves the tracker on the previous complete checkpoint.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from megatron_hetermoe.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TRACKER,
    RankState,
    _fsync_dir,
    _write_atomic,
    iter_dir_name,
    rank_file_name,
    rank_payload,
    sha256_file,
)

# Tests set this to inject a crash: called as FAULT_HOOK(stage, rank, iteration) at
# "rank_file" (a rank's file is written), "manifest" (manifest written, directory not yet
# renamed) and "tracker" (directory renamed, tracker not yet updated).
FAULT_HOOK: Callable[[str, int, int], None] | None = None


def _fault(stage: str, rank: int, iteration: int) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(stage, rank, iteration)


def save(state: RankState, save_dir: str | os.PathLike, iteration: int) -> Path:
    """Collective over state.group: write this iteration's checkpoint; return its directory."""
    import torch.distributed as dist

    root = Path(save_dir)
    final = root / iter_dir_name(iteration)
    tmp = root / (iter_dir_name(iteration) + ".tmp")
    if state.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("iter_*.tmp"):  # left by a crashed save; never referenced
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier(group=state.group)

    rel = rank_file_name(state.rank)
    path = tmp / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = rank_payload(state, iteration)
    _write_atomic(path, functools.partial(torch.save, payload))  # bound now: payload is dropped below
    entry = {"rank": state.rank, "role": state.role, "size": path.stat().st_size, "sha256": sha256_file(path),
             "params": {state.names[n]: list(p.shape) for n, p in state.module.named_parameters()},
             "file": rel}
    del payload
    _fault("rank_file", state.rank, iteration)

    entries = [None] * state.world_size
    dist.all_gather_object(entries, entry, group=state.group)
    if state.rank == 0:
        manifest = {"trainer": state.trainer, "world_size": state.world_size, "model": state.model,
                    "layout": state.layout, "train": state.train,
                    "files": {e["file"]: {k: v for k, v in e.items() if k != "file"} for e in entries}}
        _publish(root, iteration, manifest)
    dist.barrier(group=state.group)
    return final


def _publish(root: Path, iteration: int, manifest: dict) -> Path:
    """Rank 0's part: manifest into iter_N.tmp, rename it to iter_N, then the tracker."""
    final = root / iter_dir_name(iteration)
    tmp = root / (iter_dir_name(iteration) + ".tmp")
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "iteration": iteration, **manifest,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}
    _write_atomic(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1)), binary=False)
    _fault("manifest", 0, iteration)
    old = root / (iter_dir_name(iteration) + ".old")
    if final.exists():  # saving the same iteration again: keep the old one until the swap
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    _fault("tracker", 0, iteration)
    _write_atomic(root / TRACKER, lambda f: f.write(f"{iteration}\n"), binary=False)
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_offline(out_dir: str | os.PathLike, iteration: int, manifest: dict, payloads: list[dict]) -> Path:
    """Write a whole checkpoint from one process (import): rank files, then _publish."""
    root = Path(out_dir)
    tmp = root / (iter_dir_name(iteration) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for payload in payloads:
        rel = rank_file_name(payload["rank"])
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, lambda f: torch.save(payload, f))
        files[rel] = {"rank": payload["rank"], "role": payload["role"], "size": path.stat().st_size,
                      "sha256": sha256_file(path),
                      "params": {payload["names"][n]: list(t.shape) for n, t in payload["model"].items()}}
    return _publish(root, iteration, {**manifest, "files": files})
