"""Parameters and Adam state by canonical (PP=1, EP=1 Megatron) name: reading them from the
fewest rank files of a checkpoint and putting them into a rank of any layout. load.py uses this
to load a checkpoint saved under another layout (--hetero-ckpt-reshard) and imported
checkpoints' Adam state; export.py uses it to convert to and from plain Megatron.

Resharding (opt in): a checkpoint saved under another layout (another plan, world size, or the
baseline trainer's EP/PP) is loaded by canonical parameter name: parameters and Adam moments
move to wherever the new layout puts them. RNG states are then not restored (they belong to
ranks that no longer exist). A distributed optimizer's Adam state is sharded by gradient bucket
over its data-parallel ranks' files; each file names whose elements it holds
(format.optimizer_dp_names), so the slices are joined by name, and a distributed optimizer
being loaded takes its own shard's slice of each parameter.

Kernels: canonical names are the same under every kernels choice (plan/expert_names.py), so a
checkpoint also moves between kernels this way. A legacy GroupedMLP weight, which holds several
experts under one label, is split into its experts' canonical tensors when read (parameter and
Adam moments alike) and packed back when put into a GroupedMLP module.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_hetermoe.checkpoint.format import (
    CheckpointError,
    RankState,
    _sub_optimizers,
    _torch_load,
    verify_file,
)
from megatron_hetermoe.plan import expert_names


def canonical_optimizer_state(payload: dict) -> dict[str, dict]:
    """{canonical name: Adam state} from a rank file (raw Megatron state, or an imported one);
    a GroupedMLP weight's state is split into its experts'. A distributed optimizer's file holds
    slices of states instead (optimizer_pieces)."""
    if "optimizer_canonical" in payload:
        return _expand_optimizer_state(payload, payload["optimizer_canonical"])
    if "optimizer_dp_shard" in payload:
        raise CheckpointError(
            f"rank {payload['rank']}'s file was saved with --use-distributed-optimizer, whose Adam state is "
            f"sharded over the data-parallel ranks' files: read it with gather_canonical")
    raw = payload["optimizer"]
    raws = raw if isinstance(raw, list) else [raw]
    out: dict[str, dict] = {}
    for names, sd in zip(payload["optimizer_param_names"], raws):
        for idx, st in sd["state"].items():
            out.setdefault(names[idx], st)
    return _expand_optimizer_state(payload, out)


# Adam's state per parameter (torch's); a distributed optimizer's shard entries also hold the main
# parameter and the entry's place in the bucket.
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


def optimizer_pieces(payload: dict) -> dict[str, list[tuple[int, int, dict]]]:
    """{canonical name or GroupedMLP label: [(start, end, Adam state of the flattened elements
    start:end)]} from a rank file of a distributed optimizer: its bucket-space shard read by name
    (format.optimizer_dp_names)."""
    if "optimizer_dp_names" not in payload:
        raise CheckpointError(
            f"rank {payload['rank']}'s file was saved with --use-distributed-optimizer by an older version, "
            f"which did not record whose Adam state each bucket holds; reload it under its own layout")
    out: dict[str, list] = {}
    for shard, names in zip(payload["optimizer_dp_shard"], payload["optimizer_dp_names"]):
        for g, by_dtype in names.items():
            for dtype, buckets in by_dtype.items():
                for b, entries in enumerate(buckets):
                    for (name, start, end), tensors in zip(entries, shard[g][dtype][b], strict=True):
                        st = {k: v for k, v in tensors.items() if k in ADAM_STATE}
                        if st:
                            out.setdefault(name, []).append((start, end, st))
    return out


def _assembled(pieces: list[tuple[int, int, dict]], shape: tuple[int, ...]) -> dict | None:
    """The whole Adam state of a parameter of `shape` from its slices (replicas' duplicates
    dropped), or None while some elements are missing."""
    numel = 1
    for d in shape:
        numel *= d
    by_start = {start: (end, st) for start, end, st in pieces}
    at, parts = 0, []
    while at < numel:
        if at not in by_start:
            return None
        end, st = by_start[at]
        parts.append(st)
        at = end
    out = {}
    for k, v in parts[0].items():
        if k == "step" or not torch.is_tensor(v):
            out[k] = v
        else:
            out[k] = torch.cat([p[k].reshape(-1) for p in parts]).view(shape)
    return out


def _expand_optimizer_state(payload: dict, by_name: dict[str, dict]) -> dict[str, dict]:
    labels = [n for n in by_name if expert_names.is_label(n)]
    if not labels:
        return by_name
    shapes = {payload["names"][local]: tuple(t.shape) for local, t in payload.get("model", {}).items()}
    out = {n: st for n, st in by_name.items() if not expert_names.is_label(n)}
    for n in labels:
        out.update(expert_names.unpack_optimizer_state(n, by_name[n], shapes[n]))
    return out


@torch.no_grad()
def inject_optimizer_state(state: RankState, by_name: dict[str, dict]) -> int:
    """Put Adam moments (by canonical name) into this rank's Megatron optimizer; return how
    many parameters got a state. A distributed optimizer gets the slice of each of its shard's
    parameters."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    by_id = {id(p): state.names[n] for n, p in state.module.named_parameters()}
    n = 0
    for sub in _sub_optimizers(state.optimizer):
        if isinstance(sub, DistributedOptimizer):
            n += _inject_distributed(sub, by_id, by_name)
            continue
        inner = sub.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                st = _state_of(by_id[id(p)], by_name)
                if st is not None:
                    inner.state[p] = {k: _state_value(k, v, p, g) for k, v in st.items()}
                    n += 1
    return n


def _state_of(name: str, by_name: dict[str, dict]) -> dict | None:
    return expert_names.pack_optimizer_state(name, by_name) if expert_names.is_label(name) else by_name.get(name)


def _inject_distributed(sub, by_id: dict[int, str], by_name: dict[str, dict]) -> int:
    """A DistributedOptimizer's shard: each model parameter's range of this data-parallel rank,
    into the Adam state of the main parameter that is that range (fp32: a view of the model
    parameter, loaded with it; --bf16/--fp16 are refused with --hetero-ckpt-reshard)."""
    if sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        raise CheckpointError("loading Adam state by name into --use-precision-aware-optimizer is not built; "
                              "drop that flag to reshard")
    inner, n = sub.optimizer, 0
    for maps in sub.gbuf_ranges:
        for buckets in maps.values():
            for bucket in buckets:
                for model_param, r in bucket["param_map"].items():
                    st = _state_of(by_id[id(model_param)], by_name)
                    if st is None:
                        continue
                    gi, order = sub.model_param_group_index_map[model_param]
                    group = inner.param_groups[gi]
                    main = group["params"][order]
                    lo, hi = r["param"].start, r["param"].end
                    inner.state[main] = {k: _state_value(k, v if k == "step" or not torch.is_tensor(v)
                                                         else v.reshape(-1)[lo:hi], main, group)
                                         for k, v in st.items()}
                    n += 1
    return n


def _state_value(key: str, v, p: torch.Tensor, group: dict):
    """A copy of a loaded (CPU) optimizer state value, where torch's own load_state_dict puts
    it: on the parameter's device, except a non-fused, non-capturable Adam's "step" (CPU)."""
    if not torch.is_tensor(v):
        return v
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return v.clone()
    return v.to(p.device, copy=True)


@torch.no_grad()
def load_canonical_params(state: RankState, params: dict[str, torch.Tensor]) -> None:
    local = expert_names.module_state({n: state.names[n] for n, _ in state.module.named_parameters()}, params)
    for n, p in state.module.named_parameters():
        p.copy_(local[n])


def gather_canonical(iter_dir: Path, manifest: dict, wanted: set[str] | None = None) -> tuple[dict, dict, dict]:
    """(params, Adam states, first file's payload) by canonical name, read from the fewest files
    that hold `wanted` (all parameters when None; GroupedMLP labels stand for their experts).
    Replicas agree; the first copy is kept. A distributed optimizer's Adam state is sharded over
    the data-parallel ranks' files: those are read until each wanted state is whole."""
    want = expert_names.expand_names(wanted if wanted is not None else
                                     {n for m in manifest["files"].values() for n in m["params"]})
    need = set(want)
    params: dict[str, torch.Tensor] = {}
    opt: dict[str, dict] = {}
    pieces: dict[str, list] = {}  # label or name -> slices of its Adam state, while not whole
    pending: set[str] = set()  # canonical names of those
    first = None
    for rel, meta in sorted(manifest["files"].items(), key=lambda kv: kv[1]["rank"]):
        if not (need | pending) & expert_names.expand_names(meta["params"]) and first is not None:
            continue
        payload = _torch_load(verify_file(iter_dir, manifest, rel))
        first = first or payload
        held = expert_names.expand({payload["names"][local]: t for local, t in payload["model"].items()})
        by_name = {} if "optimizer_dp_shard" in payload else canonical_optimizer_state(payload)
        for c, t in held.items():
            if c in need and c not in params:
                params[c] = t
                if c in by_name:
                    opt[c] = by_name[c]
        if "optimizer_dp_shard" in payload:
            shapes = {payload["names"][local]: tuple(t.shape) for local, t in payload["model"].items()}
            for name, slices in optimizer_pieces(payload).items():
                members = expert_names.expand_names({name})
                if not members & want or members <= set(opt):
                    continue
                pieces.setdefault(name, []).extend(slices)
                whole = _assembled(pieces[name], shapes[name])
                if whole is None:
                    pending |= members
                    continue
                del pieces[name]
                pending -= members
                opt.update(_expand_optimizer_state(payload, {name: whole}))
        need -= set(params)
        if not need and not pending:
            break
    if need:
        raise CheckpointError(f"{iter_dir}: no file holds {sorted(need)[:3]}")
    if pending:
        raise CheckpointError(f"{iter_dir}: the distributed optimizer's Adam state of {sorted(pending)[:3]} is "
                              f"not whole in its files (a data-parallel rank's file missing from the manifest?)")
    return params, opt, first
