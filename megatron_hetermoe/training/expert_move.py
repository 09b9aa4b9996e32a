"""Moving experts between ranks at a step boundary (issue 46 item 4): the state of every
parameter a rank holds, whole and by canonical name (plan/expert_names.py, the names checkpoints
reshard by), sent from its old holder to its new one with point-to-point messages, and put into
the rank's rebuilt module and optimizer.

What a parameter's state is (`ParamState`): the model parameter (its dtype), the fp32 main
parameter where Megatron's optimizer keeps one (--bf16/--fp16; None where the optimizer steps the
parameter itself), and Adam's state (exp_avg, exp_avg_sq, step). Under the distributed optimizer
a rank holds a slice of each main parameter and of its moments (its data-parallel shard): the
slices are gathered over the sub-optimizer's data-parallel group first (`whole_states`), and the
rebuilt distributed optimizer takes its new shard's slice (`load_optimizer_states`). Gradients are
not moved: a move happens between steps, where Megatron zeroes every gradient buffer anyway.

The exchange (`exchange`): each ZP group moves its own copies (member positions do not change,
so the replica groups do not either); one small all_gather_object over the world says what each
sender sends (names, shapes, dtypes), then one message per (sender, receiver) pair carries the
bytes (batch_isend_irecv over the world group: gloo on CPU ranks, NCCL on GPUs).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_hetermoe.plan import expert_names
from megatron_hetermoe.plan.hetero_plan import HeteroPlan

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
_SEQ_ID = re.compile(r"^local_experts\.(\d+)\.")


@dataclass
class ParamState:
    """One parameter's whole state (module docstring)."""
    param: torch.Tensor
    main: torch.Tensor | None = None
    adam: dict[str, torch.Tensor] = field(default_factory=dict)

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        out = [("param", self.param)] + ([("main", self.main)] if self.main is not None else [])
        return out + [(k, self.adam[k]) for k in ADAM_KEYS if k in self.adam]


@dataclass
class MoveStats:
    """One move, as every rank sees it (bytes: summed over the world)."""
    experts: int = 0  # (layer, expert) pairs of group 0 that changed holder
    bytes: int = 0  # sent over the world, all ZP groups
    gather_s: float = 0.0  # whole states (the distributed optimizer's slices gathered)
    exchange_s: float = 0.0  # metadata + point-to-point
    rebuild_s: float = 0.0  # module, DDP, optimizer, schedule rebuilt and loaded
    seconds: float = 0.0  # the whole move, slowest rank

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def expert_of(name: str, plan: HeteroPlan) -> tuple[int, int] | None:
    """(MoE layer, expert id) of a canonical expert parameter name, else None."""
    s = expert_names.split_expert(name)
    if s is None:
        return None
    pre, rel = s
    m = _SEQ_ID.match(rel)
    if m is None:
        raise ValueError(f"{name}: not a per-expert canonical name; live moves need per-expert parameters "
                         f"(GroupedMLP's packed weights are not moved: use --moe-grouped-gemm off or TE's grouped MLP)")
    layer = plan.moe_index(expert_names.model_layer_of_prefix(pre, plan.decoder_layers))
    return layer, int(m.group(1))


def _subs(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _as_allocated(tensor: torch.Tensor) -> torch.Tensor:
    """An init method that draws nothing: the tensor stays as allocated."""
    return tensor


def rebuild_config(config):
    """The model config a live move builds a rank's module with. Every parameter then comes from the
    moved states, so no random initialization is needed (most of a rebuild's time), but Megatron's
    initialization must still run: megatron-core 0.16's parallel layers set a weight's
    tensor-parallel attributes (`tensor_model_parallel`, `partition_dim`) only there (0.19 sets
    them either way), and without them the gradient norm takes a TP rank's shards for duplicates
    of rank 0's and leaves them out. So the init methods are ones that draw nothing (nor touch the
    RNG), instead of perform_initialization=False."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config)}
    kept = {n: _as_allocated for n in ("init_method", "output_layer_init_method", "embedding_init_method")
            if n in names}
    return dataclasses.replace(config, perform_initialization=True, **kept)


def carry_loss_scale(old, new) -> None:
    """The rebuilt Megatron optimizer `new` takes `old`'s loss scaler state (one loss scale for the
    world: every sub-optimizer with a scaler gets the first one's)."""
    scalers = [o.grad_scaler for o in _subs(old) if getattr(o, "grad_scaler", None) is not None]
    if not scalers:
        return
    for o in _subs(new):
        if getattr(o, "grad_scaler", None) is not None:
            o.grad_scaler.load_state_dict(scalers[0].state_dict())


def _main_params(sub) -> list[tuple[torch.Tensor, torch.Tensor | None, int, int, dict]]:
    """(model parameter, its main parameter (None: the model parameter itself), the flattened
    range the main parameter covers, the inner param group) for every parameter `sub` steps."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = sub.optimizer
    out = []
    if isinstance(sub, DistributedOptimizer):
        for maps in sub.gbuf_ranges:
            for buckets in maps.values():
                for bucket in buckets:
                    for model_param, r in bucket["param_map"].items():
                        gi, order = sub.model_param_group_index_map[model_param]
                        group = inner.param_groups[gi]
                        main = group["params"][order]
                        lo, hi = r["param"].start, r["param"].end
                        out.append((model_param, main, lo, hi, group))
        return out
    if hasattr(sub, "float16_groups"):  # Float16OptimizerWithFloat16Params
        groups = {id(p): g for g in inner.param_groups for p in g["params"]}
        for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out.append((p, main, 0, p.numel(), groups[id(main)]))
        for group in sub.fp32_from_fp32_groups:
            for p in group:
                out.append((p, p, 0, p.numel(), groups[id(p)]))
        return out
    for group in inner.param_groups:  # FP32Optimizer: Adam steps the model parameters
        for p in group["params"]:
            out.append((p, p, 0, p.numel(), group))
    return out


@torch.no_grad()
def whole_states(module: torch.nn.Module, names: dict[str, str], optimizer) -> dict[str, ParamState]:
    """Every parameter of this rank's module, whole, by canonical name (module docstring).
    Collective over each distributed sub-optimizer's data-parallel group (in chain order, which
    is the same on every member of such a group)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    by_id = {id(p): names[n] for n, p in module.named_parameters()}
    out = {names[n]: ParamState(p.detach().clone()) for n, p in module.named_parameters()}
    for sub in _subs(optimizer):
        inner = sub.optimizer
        pieces: dict[str, list] = {}
        for model_param, main, lo, hi, _ in _main_params(sub):
            name = by_id[id(model_param)]
            own = main is model_param or model_param.dtype == torch.float32  # fp32: a view of the parameter
            st = {k: v for k, v in inner.state.get(main, {}).items() if k in ADAM_KEYS}
            if not isinstance(sub, DistributedOptimizer):
                out[name].main = None if own else main.detach().clone()
                out[name].adam = {k: v.detach().clone() for k, v in st.items()}
                continue
            pieces.setdefault(name, []).append((lo, hi, None if own else main.detach().cpu().clone(),
                                                {k: v.detach().cpu().clone() for k, v in st.items()}))
        if not isinstance(sub, DistributedOptimizer):
            continue
        group = sub.data_parallel_group
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, pieces, group=group)
        for name, st in out.items():
            got = sorted((p for peer in everyone for p in peer.get(name, [])), key=lambda p: p[0])
            if not got:
                continue
            slices, at = [], 0
            for lo, hi, main, adam in got:
                if lo == at:  # replicas' duplicates (a bucket's padding aside) are skipped
                    slices.append((main, adam))
                    at = hi
            if at != st.param.numel():
                raise RuntimeError(f"{name}: the distributed optimizer's slices cover {at} of {st.param.numel()} "
                                   f"elements; its data-parallel group lost a shard")
            dev, shape = st.param.device, st.param.shape
            if slices[0][0] is not None:
                st.main = torch.cat([m.reshape(-1) for m, _ in slices]).view(shape).to(dev)
            st.adam = {k: (v if k == "step" else torch.cat([a[k].reshape(-1) for _, a in slices]).view(shape).to(dev))
                       for k, v in slices[0][1].items()}
    return out


@torch.no_grad()
def load_optimizer_states(module: torch.nn.Module, names: dict[str, str], optimizer,
                          states: dict[str, ParamState]) -> None:
    """Put the main parameters and Adam state of `states` into a freshly built optimizer (its
    model parameters already hold `states`' values): a distributed optimizer takes its shard's
    slice of each."""
    by_id = {id(p): names[n] for n, p in module.named_parameters()}
    for sub in _subs(optimizer):
        inner = sub.optimizer
        for model_param, main, lo, hi, group in _main_params(sub):
            st = states[by_id[id(model_param)]]
            if st.main is not None and main is not model_param:
                main.copy_(st.main.reshape(-1)[lo:hi].view(main.shape))
            if st.adam:
                inner.state[main] = {k: _put(k, v, main, lo, hi, group) for k, v in st.adam.items()}


def _put(key: str, v: torch.Tensor, main: torch.Tensor, lo: int, hi: int, group: dict) -> torch.Tensor:
    """A state value where torch's Adam keeps it: `step` on the CPU unless fused or capturable,
    moments beside the main parameter (its slice under the distributed optimizer)."""
    if key == "step":
        return v.clone() if group.get("capturable") or group.get("fused") else v.detach().to("cpu", copy=True)
    return v.reshape(-1)[lo:hi].view(main.shape).to(main.device, copy=True)


def _pack(parts: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    return torch.cat([t.detach().to(device).reshape(-1).contiguous().view(torch.uint8) for _, t in parts]) \
        if parts else torch.empty(0, dtype=torch.uint8, device=device)


def exchange(states: dict[str, ParamState], old: HeteroPlan, new: HeteroPlan, rank: int, group,
             device: torch.device) -> tuple[dict[str, ParamState], int]:
    """This rank's whole states under `new`: what it keeps, and what the old holders of its new
    experts send it (module docstring). Collective over `group` (the world). Returns (states,
    bytes sent over the world)."""
    outgoing: dict[int, list[tuple[str, str, torch.Tensor]]] = {}
    kept: dict[str, ParamState] = {}
    for name, st in states.items():
        x = expert_of(name, old)
        dst = rank if x is None else new.groups[new.group_of(rank)].owner(x[0])[x[1]]
        if dst == rank:
            kept[name] = st
        else:
            outgoing.setdefault(dst, []).extend((name, part, t) for part, t in st.parts())
    meta = {dst: [(n, part, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, part, t in items]
            for dst, items in outgoing.items()}
    world = [None] * dist.get_world_size(group)
    dist.all_gather_object(world, meta, group=group)
    total = 0
    for m in world:
        for items in m.values():
            for _, _, shape, dtype in items:
                total += _nbytes(shape, dtype)
    ops, inbox = [], {}
    for dst in sorted(outgoing):
        buf = _pack([(p, t) for _, p, t in outgoing[dst]], device)
        ops.append(dist.P2POp(dist.isend, buf, dst, group=group))
    for src, m in enumerate(world):
        items = m.get(rank)
        if items:
            inbox[src] = (items, torch.empty(sum(_nbytes(s, d) for _, _, s, d in items), dtype=torch.uint8,
                                             device=device))
            ops.append(dist.P2POp(dist.irecv, inbox[src][1], src, group=group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for items, buf in inbox.values():
        at = 0
        for name, part, shape, dtype in items:
            n = _nbytes(shape, dtype)
            t = buf[at:at + n].view(getattr(torch, dtype)).reshape(shape).clone()
            at += n
            st = kept.setdefault(name, ParamState(t)) if part == "param" else kept[name]
            if part == "main":
                st.main = t
            elif part in ADAM_KEYS:
                st.adam[part] = t.cpu() if part == "step" else t
    return kept, total


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * getattr(torch, dtype).itemsize


def timed(fn, *args, **kw):
    """(fn's result, its wall seconds)."""
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0
