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

Atomic: ranks write into SAVE/iter_N.tmp/, rank 0 writes the manifest there, renames the
directory to iter_N and only then rewrites the tracker (temp file + rename). A crash at any
point leaves the tracker on the previous complete checkpoint.

Refusal: before any state is touched, every rank checks the manifest against its model shape
and layout and its files' sizes and sha256, and the ranks agree on the outcome (one collective),
so a bad checkpoint fails every rank with the same message instead of hanging the healthy ones.

Resharding (opt in): a checkpoint saved under another layout (another plan, world size, or the
baseline trainer's EP/PP) is loaded by canonical parameter name: parameters and Adam moments
move to wherever the new layout puts them. RNG states are then not restored (they belong to
ranks that no longer exist).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT = "megatron_hetermoe.checkpoint"
FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name and content
MANIFEST = "manifest.json"
RANK_FILE = "model_optim_rng.pt"  # Megatron's file name
# ModelConfig fields that decide parameter shapes (seq_length and the aux-loss coefficient do not).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
                "num_experts", "moe_router_topk", "vocab_size")

# Tests set this to inject a crash: called as FAULT_HOOK(stage, rank, iteration) at
# "rank_file" (a rank's file is written), "manifest" (manifest written, directory not yet
# renamed) and "tracker" (directory renamed, tracker not yet updated).
FAULT_HOOK: Callable[[str, int, int], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the fix."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}/{RANK_FILE}"


# ---- the state of one rank ----------------------------------------------------------------
@dataclass
class RankState:
    """What one rank saves and loads, and how it is laid out."""

    trainer: str  # "megatron" (trainer.train) or "hetero" (hetero_trainer.train_hetero)
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
        "role": state.role,
        "model": {n: p.detach().clone() for n, p in state.module.named_parameters()},
        "names": dict(state.names),
        "optimizer": opt.state_dict(),
        "optimizer_param_names": optimizer_param_names(state),
        "opt_param_scheduler": state.scheduler.state_dict(),
        "rng_state": get_rng_state(),
    }
    if _is_distributed(opt):
        # The distributed optimizer keeps Adam moments out of state_dict(); Megatron saves them
        # per DP rank in bucket space (exact resume only, not reshardable by name).
        payload["optimizer_dp_shard"] = [o.get_parameter_state_dp_reshardable() for o in _sub_optimizers(opt)]
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


def _fault(stage: str, rank: int, iteration: int) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(stage, rank, iteration)


# ---- save --------------------------------------------------------------------------------
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
    _write_atomic(path, lambda f: torch.save(payload, f))
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


# ---- inspect and validate (no process group needed) --------------------------------------
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


def model_difference(saved: dict, now: dict) -> list[str]:
    return [f"{k} {saved.get(k)} in the checkpoint, {now.get(k)} now" for k in SHAPE_FIELDS
            if saved.get(k) != now.get(k)]


def plan_difference(saved: dict, now: dict) -> list[str]:
    """Differences between two plans (dicts) that change which rank holds which parameters."""
    out = []
    ws, wn = len(saved["gpu_types"]), len(now["gpu_types"])
    if ws != wn:
        out.append(f"world size {ws} in the checkpoint's plan, {wn} now")
    gs, gn = saved["groups"], now["groups"]
    if len(gs) != len(gn):
        out.append(f"{len(gs)} ZP groups in the checkpoint's plan, {len(gn)} now")
    for i, (a, b) in enumerate(zip(gs, gn)):
        for key in ("attention_ranks", "expert_ranks"):
            if list(a[key]) != list(b[key]):
                out.append(f"ZP group {i} {key} {a[key]} in the checkpoint's plan, {b[key]} now")
        for layer, (pa, pb) in enumerate(zip(a["placement"], b["placement"])):
            for r in sorted({int(r) for r in pa} | {int(r) for r in pb}):
                ea, eb = sorted(pa.get(str(r), pa.get(r, []))), sorted(pb.get(str(r), pb.get(r, [])))
                if ea != eb:
                    out.append(f"layer {layer} of ZP group {i}: rank {r} holds experts {ea} in the "
                               f"checkpoint's plan, {eb} now")
    return out


def layout_difference(manifest: dict, state_trainer: str, layout: dict, world_size: int) -> list[str]:
    if manifest["trainer"] != state_trainer:
        return [f"saved by the {manifest['trainer']} trainer, loading into the {state_trainer} trainer"]
    if state_trainer == "hetero":
        return plan_difference(manifest["layout"]["plan"], layout["plan"])
    out = [f"{k} {manifest['layout'].get(k)} in the checkpoint, {v} now" for k, v in layout.items()
           if manifest["layout"].get(k) != v]
    if manifest["world_size"] != world_size and not out:
        out.append(f"world size {manifest['world_size']} in the checkpoint, {world_size} now")
    return out


def check_compatible(manifest: dict, iter_dir: Path, state: RankState, reshard: bool) -> bool:
    """Raise CheckpointError for a checkpoint this rank cannot load; return whether it must be
    resharded (loaded by canonical name) rather than read back as it was written."""
    diff = model_difference(manifest["model"], state.model)
    if diff:
        raise CheckpointError(
            f"{iter_dir}: model shape differs: {'; '.join(diff)}; load it with the model it was saved with "
            f"(--model {manifest['model'].get('name')})")
    diff = layout_difference(manifest, state.trainer, state.layout, state.world_size)
    if diff and not reshard:
        raise CheckpointError(
            f"{iter_dir}: saved under a different layout: {'; '.join(diff[:6])}"
            f"{f' (+{len(diff) - 6} more)' if len(diff) > 6 else ''}; run with the layout (plan) it was saved "
            f"with, or pass --hetero-ckpt-reshard to move its parameters and optimizer state to this layout by name")
    # Shapes by canonical name: catches what the model config alone would not (e.g. a hand-edited
    # manifest or a model built differently).
    mine = {state.names[n]: list(p.shape) for n, p in state.module.named_parameters()}
    rel = rank_file_name(state.rank)
    held = manifest["files"].get(rel, {}).get("params", {}) if not diff else {}
    if not diff and set(held) != set(mine):
        raise CheckpointError(
            f"{iter_dir / rel}: holds parameters {sorted(set(held) - set(mine))[:3]} this rank lacks and lacks "
            f"{sorted(set(mine) - set(held))[:3]}; the layout differs, pass --hetero-ckpt-reshard")
    everywhere = {}
    for f, meta in manifest["files"].items():
        for n, s in meta["params"].items():
            everywhere.setdefault(n, (f, s))
    for n, s in mine.items():
        if n not in everywhere:
            raise CheckpointError(f"{iter_dir}: no file holds parameter {n}; the model differs from the saved one")
        f, saved = everywhere[n]
        if list(saved) != s:
            raise CheckpointError(f"{iter_dir / f}: parameter {n} has shape {tuple(saved)} in the checkpoint, "
                                  f"{tuple(s)} in this model; load it with the model it was saved with")
    return bool(diff)


# ---- load --------------------------------------------------------------------------------
def _agree(error: str | None, state: RankState) -> None:
    """Every rank raises the first rank's error, or none does."""
    import torch.distributed as dist

    errors = [None] * state.world_size
    dist.all_gather_object(errors, error, group=state.group)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        more = f" (ranks {[b for b, _ in bad]} refused)" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint refused on rank {r}: {e}{more}")


def _torch_load(path: Path) -> dict:
    # weights_only=False: the file holds RNG states (tuples, numpy arrays); it was checked
    # against the manifest's sha256 first.
    return torch.load(path, map_location="cpu", weights_only=False)


def canonical_optimizer_state(payload: dict) -> dict[str, dict]:
    """{canonical name: Adam state} from a rank file (raw Megatron state, or an imported one)."""
    if "optimizer_canonical" in payload:
        return payload["optimizer_canonical"]
    if "optimizer_dp_shard" in payload:
        raise CheckpointError(
            f"rank {payload['rank']}'s file was saved with --use-distributed-optimizer, whose Adam state is "
            f"sharded by gradient bucket, not by parameter; reload it under its own layout")
    raw = payload["optimizer"]
    raws = raw if isinstance(raw, list) else [raw]
    out: dict[str, dict] = {}
    for names, sd in zip(payload["optimizer_param_names"], raws):
        for idx, st in sd["state"].items():
            out.setdefault(names[idx], st)
    return out


@torch.no_grad()
def inject_optimizer_state(state: RankState, by_name: dict[str, dict]) -> int:
    """Put Adam moments (by canonical name) into this rank's Megatron optimizer; return how
    many parameters got a state."""
    if _is_distributed(state.optimizer):
        raise CheckpointError("loading optimizer state by name into --use-distributed-optimizer is not "
                              "supported; drop that flag to reshard")
    by_id = {id(p): state.names[n] for n, p in state.module.named_parameters()}
    n = 0
    for sub in _sub_optimizers(state.optimizer):
        inner = sub.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                st = by_name.get(by_id[id(p)])
                if st is not None:
                    inner.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                    n += 1
    return n


def _mark_unpadded(shard: dict) -> dict:
    """megatron-core 0.16.1's load_parameter_state_from_dp_reshardable reads a 'padding' flag that
    get_parameter_state_dp_reshardable does not write (its sharded path adds padding=False to
    real entries the same way)."""
    for gbuf_idx, by_dtype in shard.items():
        if isinstance(gbuf_idx, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for elem in bucket:
                        elem.setdefault("padding", False)
    return shard


@torch.no_grad()
def load_canonical_params(state: RankState, params: dict[str, torch.Tensor]) -> None:
    for n, p in state.module.named_parameters():
        p.copy_(params[state.names[n]])


def gather_canonical(iter_dir: Path, manifest: dict, wanted: set[str] | None = None) -> tuple[dict, dict, dict]:
    """(params, Adam states, first file's payload) by canonical name, read from the fewest files
    that hold `wanted` (all parameters when None). Replicas agree; the first copy is kept."""
    need = set(wanted) if wanted is not None else {n for m in manifest["files"].values() for n in m["params"]}
    params: dict[str, torch.Tensor] = {}
    opt: dict[str, dict] = {}
    first = None
    for rel, meta in sorted(manifest["files"].items(), key=lambda kv: kv[1]["rank"]):
        if not need & set(meta["params"]) and first is not None:
            continue
        payload = _torch_load(verify_file(iter_dir, manifest, rel))
        first = first or payload
        by_name = canonical_optimizer_state(payload)
        for local, t in payload["model"].items():
            c = payload["names"][local]
            if c in need and c not in params:
                params[c] = t
                if c in by_name:
                    opt[c] = by_name[c]
        need -= set(params)
        if not need:
            break
    if need:
        raise CheckpointError(f"{iter_dir}: no file holds {sorted(need)[:3]}")
    return params, opt, first


def load(state: RankState, load_dir: str | os.PathLike, step: int | None = None, reshard: bool = False) -> int:
    """Collective over state.group: restore this rank from a checkpoint; return its iteration
    (0 when load_dir holds no checkpoint yet, as Megatron starts from scratch then)."""
    error, iteration, payload, resharded = None, 0, None, False
    try:
        if step is None and read_tracker(load_dir) is None:
            iteration = -1  # nothing to load
        else:
            iter_dir, manifest = locate(load_dir, step)
            iteration = manifest["iteration"]
            resharded = check_compatible(manifest, iter_dir, state, reshard)
            if resharded:
                mine = set(state.names.values())
                params, opt, first = gather_canonical(iter_dir, manifest, mine)
                payload = {"params": params, "opt": opt, "opt_param_scheduler": first["opt_param_scheduler"]}
            else:
                payload = _torch_load(verify_file(iter_dir, manifest, rank_file_name(state.rank)))
                if payload.get("iteration") != iteration or payload.get("rank") != state.rank:
                    raise CheckpointError(f"{iter_dir / rank_file_name(state.rank)}: holds rank "
                                          f"{payload.get('rank')} iteration {payload.get('iteration')}, "
                                          f"expected rank {state.rank} iteration {iteration}")
    except CheckpointError as e:
        error = str(e)
    except (OSError, RuntimeError, KeyError, ValueError, EOFError) as e:  # unreadable despite the checks
        error = f"{load_dir}: could not be read ({type(e).__name__}: {e})"
    _agree(error, state)
    if iteration == -1:
        if state.rank == 0:
            print(f" WARNING: no checkpoint in {load_dir} ({TRACKER} missing); training from scratch", flush=True)
        return 0
    if resharded:
        load_canonical_params(state, payload["params"])
        inject_optimizer_state(state, payload["opt"])
    else:
        from megatron_hetermoe.plan.layout import load_params

        load_params(state.module, payload["model"])
        if payload.get("optimizer") is not None:
            state.optimizer.load_state_dict(payload["optimizer"])
            if "optimizer_dp_shard" in payload:
                for sub, shard in zip(_sub_optimizers(state.optimizer), payload["optimizer_dp_shard"]):
                    with torch.no_grad():  # it copies into main params that require grad
                        sub.load_parameter_state_from_dp_reshardable(_mark_unpadded(shard))
                    # megatron-core 0.16.1 without apex/TE gives every parameter the *same* 'step'
                    # tensor on load, which torch's Adam then increments once per parameter.
                    for st in sub.optimizer.state.values():
                        if torch.is_tensor(st.get("step")):
                            st["step"] = st["step"].clone()
        else:  # imported from a plain Megatron checkpoint: Adam state by name
            inject_optimizer_state(state, payload["optimizer_canonical"])
        if payload.get("rng_state") is not None:
            set_rng_state(payload["rng_state"])
    # Megatron's scheduler re-derives lr/wd for every param group from num_steps on load.
    state.scheduler.load_state_dict(payload["opt_param_scheduler"])
    if state.rank == 0:
        how = " (resharded by parameter name; RNG states not restored)" if resharded else ""
        print(f" loaded checkpoint {load_dir} at iteration {iteration}{how}", flush=True)
    return iteration


# ---- the trainers' hook --------------------------------------------------------------------
class Checkpointer:
    """Megatron's --save/--load/--save-interval/--ckpt-step for one rank's training loop."""

    def __init__(self, state: RankState, save_dir: str | None = None, load_dir: str | None = None,
                 save_interval: int | None = None, ckpt_step: int | None = None, reshard: bool = False):
        if save_interval is not None and save_interval < 1:
            raise ValueError(f"--save-interval {save_interval} must be a positive number of iterations")
        self.state, self.save_dir, self.load_dir = state, save_dir, load_dir
        self.save_interval, self.ckpt_step, self.reshard = save_interval, ckpt_step, reshard
        self.last_saved: int | None = None
        self.start = 0

    @classmethod
    def from_config(cls, cfg, state: RankState) -> "Checkpointer":
        return cls(state, cfg.save, cfg.load, cfg.save_interval, cfg.ckpt_step, cfg.ckpt_reshard)

    def resume(self) -> int:
        """Load if --load was given; return the iteration to continue from."""
        if self.load_dir:
            self.start = load(self.state, self.load_dir, self.ckpt_step, self.reshard)
            self.last_saved = self.start
        return self.start

    def after_step(self, iteration: int) -> None:
        if self.save_dir and self.save_interval and iteration % self.save_interval == 0:
            save(self.state, self.save_dir, iteration)
            self.last_saved = iteration

    def finish(self, iteration: int) -> None:
        """Megatron saves once more at the end unless the last iteration was just saved."""
        if self.save_dir and iteration != self.last_saved and iteration > 0:
            save(self.state, self.save_dir, iteration)
            self.last_saved = iteration


def _train_dict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
                                         "train_iters", "micro_batch_size", "global_batch_size", "seed")}


def megatron_checkpointer(cfg, module, names: dict[str, str], optimizer, scheduler) -> Checkpointer:
    """The baseline trainer's checkpointer (call after initialize_model_parallel)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    par = cfg.parallel
    layout = {"tensor-model-parallel-size": par.tp, "pipeline-model-parallel-size": par.pp,
              "expert-model-parallel-size": par.ep, "data-parallel-size": ps.get_data_parallel_world_size(),
              "use-distributed-optimizer": cfg.use_distributed_optimizer}
    state = RankState("megatron", dist.get_rank(), dist.get_world_size(), "megatron", module, dict(names),
                      optimizer, scheduler, asdict(cfg.model), layout, _train_dict(cfg))
    return Checkpointer.from_config(cfg, state)


def hetero_checkpointer(cfg, hs, module, names: dict[str, str], optimizer, scheduler) -> Checkpointer:
    """A HeterMoE rank's checkpointer; the layout is the plan (schedule, GPU types and R do not
    change who holds what, so they may differ between save and load)."""
    state = RankState("hetero", hs.rank, hs.plan.world_size, hs.role, module, dict(names), optimizer,
                      scheduler, asdict(cfg.model), {"plan": hs.plan.to_dict()}, _train_dict(cfg),
                      group=hs.world_group)
    return Checkpointer.from_config(cfg, state)
