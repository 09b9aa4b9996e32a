"""Parameters and Adam state by canonical (PP=1, EP=1 Megatron) name: reading them from the
fewest rank files of a checkpoint and putting them into a rank of any layout. load.py uses this
to load a checkpoint saved under another layout (--hetero-ckpt-reshard) and imported
checkpoints' Adam state; export.py uses it to convert to and from plain Megatron.

Resharding (opt in): a checkpoint saved under another layout (another plan, world size, or the
baseline trainer's EP/PP) is loaded by canonical parameter name: parameters and Adam moments
move to wherever the new layout puts them. RNG states are then not restored (they belong to
ranks that no longer exist).

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
    _is_distributed,
    _sub_optimizers,
    _torch_load,
    verify_file,
)
from megatron_hetermoe.plan import expert_names


def canonical_optimizer_state(payload: dict) -> dict[str, dict]:
    """{canonical name: Adam state} from a rank file (raw Megatron state, or an imported one);
    a GroupedMLP weight's state is split into its experts'."""
    if "optimizer_canonical" in payload:
        return _expand_optimizer_state(payload, payload["optimizer_canonical"])
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
    return _expand_optimizer_state(payload, out)


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
                c = by_id[id(p)]
                st = expert_names.pack_optimizer_state(c, by_name) if expert_names.is_label(c) else by_name.get(c)
                if st is not None:
                    inner.state[p] = {k: _state_value(k, v, p, g) for k, v in st.items()}
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
    Replicas agree; the first copy is kept."""
    need = expert_names.expand_names(wanted if wanted is not None else
                                     {n for m in manifest["files"].values() for n in m["params"]})
    params: dict[str, torch.Tensor] = {}
    opt: dict[str, dict] = {}
    first = None
    for rel, meta in sorted(manifest["files"].items(), key=lambda kv: kv[1]["rank"]):
        if not need & expert_names.expand_names(meta["params"]) and first is not None:
            continue
        payload = _torch_load(verify_file(iter_dir, manifest, rel))
        first = first or payload
        by_name = canonical_optimizer_state(payload)
        held = expert_names.expand({payload["names"][local]: t for local, t in payload["model"].items()})
        for c, t in held.items():
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
