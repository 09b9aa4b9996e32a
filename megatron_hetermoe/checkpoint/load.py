"""Loading a checkpoint: the compatibility checks (model shape, layout, parameter shapes by
name) every rank runs and agrees on before touching any state, then restoring parameters,
optimizer, scheduler and RNG states as written, or by canonical name (reshard.py) when the
checkpoint was saved under another layout.

Refusal: before any state is touched, every rank checks the manifest against its model shape
and layout and its files' sizes and sha256, and the ranks agree on the outcome (one collective),
so a bad checkpoint fails every rank with the same message instead of hanging the healthy ones.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_hetermoe.checkpoint.format import (
    TRACKER,
    CheckpointError,
    RankState,
    _sub_optimizers,
    _torch_load,
    locate,
    rank_file_name,
    read_tracker,
    set_rng_state,
    verify_file,
)
from megatron_hetermoe.checkpoint.megatron_optimizer import own_step_tensors
from megatron_hetermoe.checkpoint.reshard import (
    gather_canonical,
    inject_optimizer_state,
    load_canonical_params,
)
from megatron_hetermoe.plan import expert_names

# ModelConfig fields that decide parameter shapes (seq_length and the aux-loss coefficient do not).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
                "num_experts", "moe_router_topk", "vocab_size")


# ---- compatibility (no process group needed) ----------------------------------------------
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
    saved, now = manifest.get("train", {}).get("precision", "fp32"), state.train.get("precision", "fp32")
    if saved != now:  # Megatron's fp32 and mixed-precision optimizers keep different state
        flag = {"bf16": "--bf16", "fp16": "--fp16"}.get(saved, "neither --bf16 nor --fp16")
        raise CheckpointError(f"{iter_dir}: saved by a {saved} run, this run is {now}; load it with the precision "
                              f"it was saved with ({flag})")
    # The expert pool's (--hetero-expert-precision); absent before per-pool precision: the world's.
    saved_e = manifest.get("train", {}).get("expert_precision", saved)
    now_e = state.train.get("expert_precision", now)
    if saved_e != now_e:
        raise CheckpointError(f"{iter_dir}: its expert ranks ran {saved_e}, this run's run {now_e}; load it with "
                              f"--hetero-expert-precision {saved_e}")
    diff = layout_difference(manifest, state.trainer, state.layout, state.world_size)
    if diff and not reshard:
        raise CheckpointError(
            f"{iter_dir}: saved under a different layout: {'; '.join(diff[:6])}"
            f"{f' (+{len(diff) - 6} more)' if len(diff) > 6 else ''}; run with the layout (plan) it was saved "
            f"with, or pass --hetero-ckpt-reshard to move its parameters and optimizer state to this layout by name")
    # Shapes by canonical name: catches what the model config alone would not (e.g. a hand-edited
    # manifest or a model built differently). GroupedMLP labels count as their experts, so files
    # of other kernels compare by the same names.
    mine = _canonical_shapes({state.names[n]: list(p.shape) for n, p in state.module.named_parameters()})
    rel = rank_file_name(state.rank)
    held = _canonical_shapes(manifest["files"].get(rel, {}).get("params", {})) if not diff else {}
    if not diff and set(held) != set(mine):
        raise CheckpointError(
            f"{iter_dir / rel}: holds parameters {sorted(set(held) - set(mine))[:3]} this rank lacks and lacks "
            f"{sorted(set(mine) - set(held))[:3]}; the layout differs, pass --hetero-ckpt-reshard")
    everywhere = {}
    for f, meta in manifest["files"].items():
        for n, s in _canonical_shapes(meta["params"]).items():
            everywhere.setdefault(n, (f, s))
    for n, s in mine.items():
        if n not in everywhere:
            raise CheckpointError(f"{iter_dir}: no file holds parameter {n}; the model differs from the saved one")
        f, saved = everywhere[n]
        if list(saved) != s:
            raise CheckpointError(f"{iter_dir / f}: parameter {n} has shape {tuple(saved)} in the checkpoint, "
                                  f"{tuple(s)} in this model; load it with the model it was saved with")
    return bool(diff)


def _canonical_shapes(params: dict) -> dict[str, list[int]]:
    out = {}
    for n, shape in params.items():
        out.update({c: list(s) for c, s in expert_names.canonical_shapes(n, shape).items()})
    return out


def kernels_difference(payload: dict, state: RankState) -> str | None:
    """Why this rank cannot read its file back as written: the file names its parameters as other
    kernels do (TE, GroupedMLP or the local spec), and Megatron's optimizer state in it is in that
    model's parameter order and shapes. None when the names match, or when the file's Adam state
    is keyed by name (an imported checkpoint)."""
    mine = {n for n, _ in state.module.named_parameters()}
    saved = set(payload["model"])
    if saved == mine or payload.get("optimizer") is None:
        return None
    only_saved, only_mine = sorted(saved - mine), sorted(mine - saved)
    return (f"saved with other kernels: the file names parameters {only_saved[:2]}, this model "
            f"{only_mine[:2]} (--transformer-impl / --moe-grouped-gemm, or what imports on this machine, differ)")


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
                why = kernels_difference(payload, state)
                if why and not reshard:
                    raise CheckpointError(
                        f"{iter_dir / rank_file_name(state.rank)}: {why}; resume with the kernels it was saved "
                        f"with, or pass --hetero-ckpt-reshard to load parameters and optimizer state by name")
                if why:  # by canonical name, as under another layout
                    resharded = True
                    params, opt, first = gather_canonical(iter_dir, manifest, set(state.names.values()))
                    payload = {"params": params, "opt": opt, "opt_param_scheduler": first["opt_param_scheduler"]}
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
                    own_step_tensors(sub.optimizer)
        else:  # imported from a plain Megatron checkpoint: Adam state by name
            inject_optimizer_state(state, payload["optimizer_canonical"])
        if payload.get("rng_state") is not None:
            set_rng_state(payload["rng_state"])
    # Megatron's scheduler re-derives lr/wd for every param group from num_steps on load.
    given = _schedule(state.scheduler)
    state.scheduler.load_state_dict(payload["opt_param_scheduler"])
    if state.rank == 0:
        how = " (resharded by parameter name; RNG states not restored)" if resharded else ""
        print(f" loaded checkpoint {load_dir} at iteration {iteration}{how}", flush=True)
        note = schedule_note(given, _schedule(state.scheduler))
        if note:
            print(note, flush=True)
    return iteration


def _schedule(scheduler) -> dict[str, float]:
    """The LR schedule of a megatron-core OptimizerParamScheduler, by the flag that sets each part."""
    return {"--lr": scheduler.max_lr, "--min-lr": scheduler.min_lr, "--lr-warmup-iters": scheduler.lr_warmup_steps,
            "--train-iters": scheduler.lr_decay_steps}


def schedule_note(given: dict[str, float], loaded: dict[str, float]) -> str | None:
    """What a resumed run should know when its flags ask for another LR schedule than the
    checkpoint's: the checkpoint's stays in force (megatron-core's use_checkpoint_opt_param_scheduler,
    Megatron-LM's default), the flags given now do not change it."""
    diff = [f"{flag} {loaded[flag]:g} (given now: {given[flag]:g})" for flag in given if given[flag] != loaded[flag]]
    if not diff:
        return None
    note = (" note: resuming keeps the checkpoint's LR schedule (Megatron's use_checkpoint_opt_param_scheduler): "
            + ", ".join(diff) + "; the values given now do not change it")
    if given["--train-iters"] > loaded["--train-iters"]:
        note += (f"; training runs to --train-iters {given['--train-iters']:g}, past the schedule's end (iteration "
                 f"{loaded['--train-iters']:g}) at --min-lr {loaded['--min-lr']:g}")
    return note
