"""Checkpoints for both trainers: one file per rank, a manifest, Megatron's tracker file.

Layout (Megatron's legacy layout, one directory per rank instead of per model-parallel rank,
because a HeterMoE rank's contents depend on its role and the plan, not on tp/pp coordinates):

    SAVE/latest_checkpointed_iteration.txt      "12" (written last)
    SAVE/iter_0000012/manifest.json             format, iteration, model shape, layout (plan),
                                                and per file: rank, role, size, sha256, params
    SAVE/iter_0000012/rank_00003/model_optim_rng.pt

A rank file holds its parameters under local names plus their canonical (PP=1, EP=1 Megatron)
names, the Megatron optimizer's own state_dict(), the scheduler's state_dict(), the RNG states
(Megatron's keys) and the iteration.

This module owns the format: its names and constants, what one rank's state is and what its
file holds (RankState, rank_payload, RNG states), writing a file atomically, and reading a
checkpoint back (tracker, manifest, a rank file checked against the manifest's size and sha256).
Saving is save.py, loading load.py, state by canonical name (resharding, export) reshard.py, the
trainers' hook hooks.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_hetermoe.errors import UserError

FORMAT = "megatron_hetermoe.checkpoint"
FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name and content
MANIFEST = "manifest.json"
RANK_FILE = "model_optim_rng.pt"  # Megatron's file name


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the fix."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}/{RANK_FILE}"


# ---- the state of one rank ----------------------------------------------------------------
@dataclass
class RankState:
    """What one rank saves and loads, and how it is laid out."""

    trainer: str  # "megatron" (training.megatron_ep.train) or "hetero" (training.hetero.train_hetero)
    rank: int
    world_size: int
    role: str  # "megatron", "attention" or "expert"
    module: torch.nn.Module  # the unwrapped model (GPTModel or ExpertRuntime)
    names: dict[str, str]  # module's local parameter name -> canonical name
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer
    scheduler: Any  # OptimizerParamScheduler
    model: dict  # ModelConfig as a dict
    layout: dict  # what decides which parameters a rank holds (parallel sizes, or the plan)
    train: dict = field(default_factory=dict)  # optimizer settings, for export
    group: Any = None  # the world's process group (None: the default group)

    def canonical_params(self) -> dict[str, torch.Tensor]:
        return {self.names[n]: p for n, p in self.module.named_parameters()}


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _sub_optimizers(optimizer))


def optimizer_param_names(state: RankState) -> list[list[str]]:
    """Canonical names in the index order of each sub-optimizer's torch state_dict (torch
    numbers parameters group by group), so the raw state can be read by name later."""
    by_id = {id(p): state.names[n] for n, p in state.module.named_parameters()}
    out = []
    for sub in _sub_optimizers(state.optimizer):
        out.append([by_id.get(id(p), "?") for g in sub.optimizer.param_groups for p in g["params"]])
    return out


def optimizer_dp_names(state: RankState) -> list[dict]:
    """Per distributed sub-optimizer, what each entry of its get_parameter_state_dp_reshardable()
    holds, in its order (grad buffer, dtype, bucket, the bucket's parameters): the parameter's
    canonical name and the range of its flattened elements this rank's shard covers. With it the
    bucket-space Adam state is read by name (reshard.optimizer_pieces)."""
    by_id = {id(p): state.names[n] for n, p in state.module.named_parameters()}
    return [{g: {dtype: [[(by_id.get(id(p), "?"), r["param"].start, r["param"].end) for p, r in b["param_map"].items()]
                         for b in buckets] for dtype, buckets in maps.items()}
             for g, maps in enumerate(sub.gbuf_ranges)} for sub in _sub_optimizers(state.optimizer)]


def get_rng_state() -> dict:
    """Megatron's rng_state keys (cuda_rng_state only with real CUDA: on CPU the "CUDA"
    generator is the CPU one)."""
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    out = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(),
           "rng_tracker_states": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        out["cuda_rng_state"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(s: dict) -> None:
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(s["random_rng_state"])
    np.random.set_state(s["np_rng_state"])
    torch.set_rng_state(s["torch_rng_state"])
    if "cuda_rng_state" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(dict(s["rng_tracker_states"]))


def rank_payload(state: RankState, iteration: int) -> dict:
    """The contents of one rank file."""
    opt = state.optimizer
    payload = {
        "iteration": iteration,
        "rank": state.rank,
        "role": str(state.role),  # the plain string: a payload pickles no class of ours
        # Host copies: a copy on the rank's device would double the model's memory there at the
        # first --save-interval (the likeliest out-of-memory point on a small expert GPU).
        "model": {n: p.detach().to("cpu", copy=True) for n, p in state.module.named_parameters()},
        "names": dict(state.names),
        "optimizer": opt.state_dict(),
        "optimizer_param_names": optimizer_param_names(state),
        "opt_param_scheduler": state.scheduler.state_dict(),
        "rng_state": get_rng_state(),
    }
    if _is_distributed(opt):
        # The distributed optimizer keeps Adam moments out of state_dict(); Megatron saves them
        # per DP rank in bucket space, read back as they are (exact resume) or by name through
        # optimizer_dp_names (resharding).
        payload["optimizer_dp_shard"] = [o.get_parameter_state_dp_reshardable() for o in _sub_optimizers(opt)]
        payload["optimizer_dp_names"] = optimizer_dp_names(state)
    return payload


# ---- file helpers ------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Any], None], binary: bool = True) -> None:
    """Write through `write(f)` into path.partial, fsync, rename over path."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb" if binary else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- reading a checkpoint back (no process group needed) --------------------------------
def read_tracker(load_dir: str | os.PathLike) -> int | None:
    """The tracked iteration, or None when the directory holds no checkpoint."""
    tracker = Path(load_dir) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}; "
                              f"write the iteration of a complete iter_* directory into it")
    return int(text)


def locate(load_dir: str | os.PathLike, step: int | None = None) -> tuple[Path, dict]:
    """(iteration directory, manifest) of the tracked iteration, or of `step` (--ckpt-step)."""
    root = Path(load_dir)
    if step is None:
        step = read_tracker(root)
        if step is None:
            raise CheckpointError(f"{root}: no {TRACKER}; not a checkpoint directory (or no save finished)")
    d = root / iter_dir_name(step)
    if not d.exists() and (root / (iter_dir_name(step) + ".old")).exists():
        d = root / (iter_dir_name(step) + ".old")  # a re-save of this iteration crashed mid-swap
    if not d.is_dir():
        have = sorted(p.name for p in root.glob("iter_*") if p.is_dir())
        raise CheckpointError(f"{d}: no such checkpoint directory; {root} has {have or 'none'}")
    mpath = d / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{mpath} is missing: {d.name} is incomplete (a save that crashed?); "
                              f"load another iteration with --ckpt-step")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: not valid JSON ({e}); the manifest is damaged") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                              f"this build reads {FORMAT!r} version {FORMAT_VERSION}")
    if manifest.get("iteration") != step:
        raise CheckpointError(f"{mpath}: says iteration {manifest.get('iteration')} but sits in {d.name}")
    return d, manifest


def verify_file(iter_dir: Path, manifest: dict, rel: str) -> Path:
    """The rank file's path, after checking it exists with the manifest's size and sha256."""
    meta = manifest["files"].get(rel)
    path = iter_dir / rel
    if meta is None:
        raise CheckpointError(f"{iter_dir / MANIFEST} lists no file {rel}")
    if not path.exists():
        raise CheckpointError(f"{path} is missing (the manifest lists it); restore it or load another iteration")
    size = path.stat().st_size
    if size != meta["size"]:
        raise CheckpointError(f"{path} is {size} bytes but the manifest says {meta['size']}: the file is "
                              f"{'truncated' if size < meta['size'] else 'altered'}; restore it or load "
                              f"another iteration with --ckpt-step")
    digest = sha256_file(path)
    if digest != meta["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest[:12]}... differs from the manifest's "
                              f"{meta['sha256'][:12]}...: the file is corrupted; restore it or load another iteration")
    return path


def _torch_load(path: Path) -> dict:
    # weights_only=False: the file holds RNG states (tuples, numpy arrays); it was checked
    # against the manifest's sha256 first.
    return torch.load(path, map_location="cpu", weights_only=False)
