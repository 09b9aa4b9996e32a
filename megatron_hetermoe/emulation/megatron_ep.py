"""Plain Megatron EP timed as an emulated cluster: hooks on megatron-core's modules (attention,
experts, output layer) and its token all-to-all, so the baseline is measured as HeterMoE is."""
from __future__ import annotations

import time
from typing import Callable

import torch

from megatron_hetermoe.emulation.clock import EmulationClock, sleep_until
from megatron_hetermoe.emulation.emulator import Emulator
from megatron_hetermoe.parallel.device import rank_device
from megatron_hetermoe.vocabulary import TaskKind


def install_ep_hooks(emulator: Emulator, gpt, rank: int, ep_group_ranks: list[int], tokens_per_microbatch: float,
                     recorder=None, clock: EmulationClock | None = None, sync_group=None) -> Callable[[], None]:
    """Time one plain Megatron EP rank as its emulated GPU; returns an undo.

    The token all-to-alls are the sync points of an EP step, so time is set per segment
    between them, as the simulator models it: (previous all-to-all or microbatch start ->
    dispatch) = attention stage l, (dispatch -> combine) = this rank's experts of layer l, each
    all-to-all = its transfer time, (last combine -> loss) = the head; backward mirrors it.
    The simulator's EP step is the sum over stages of the slowest rank's stage, so the ranks
    meet at every stage boundary: an all-to-all starts when the last rank of the EP group
    could have started it (an all-reduce of those times over `sync_group`), and so do a
    microbatch and its backward (else a rank would run ahead into a stage and wait inside it,
    in a hidden collective such as the dispatcher's token counts). Every window starts when
    its inputs were there and all real work (norms, router, permutes, the loss, the
    probabilities' all-to-all) runs inside its emulated time instead of adding to it.

    The experts' window lasts the cost model's time for the tokens this rank's experts received
    in that layer and microbatch (the experts module's tokens_per_expert, on the host on CPU
    ranks), each expert's tokens over the layer's mean (the EP group's tokens x top-k / experts)
    times the balanced share, as HeterMoE's emulated expert tasks (Emulator.expert_task_time).
    Each token all-to-all lasts the collective's time for the rows each EP rank really sent each
    (its split sizes, gathered with the call time), scaled to the emulated microbatch and priced
    as HeterMoE's emulated transfers are (Emulator.transfer_task_time: planner/cluster's
    collective_time on the same links); balanced rows give the simulator's EP all-to-all
    (planner/baselines.ep_a2a_time). Its backward reverses the rows, which prices the same."""
    import torch.distributed as dist

    from megatron_hetermoe.planner.cluster import Links
    from megatron_hetermoe.shims import token_dispatcher

    m, gpu, cost = emulator.model, emulator.gpu(rank), emulator.cost
    scale = (lambda: clock.scale) if clock is not None else (lambda: emulator.spec.scale)
    t = tokens_per_microbatch
    L = m.num_layers
    per_expert = len(ep_group_ranks) * t * m.moe_router_topk / m.num_experts
    n_local = gpt.decoder.layers[0].mlp.num_local_experts
    stage = [[cost.stage_time(gpu, i, t, b) for i in range(L + 1)] for b in (False, True)]
    expert = [n_local * cost.expert_time(gpu, per_expert, b) for b in (False, True)]  # balanced
    topk = gpt.config.moe_router_topk
    n = len(ep_group_ranks)
    links = Links.for_ranks(emulator.cluster, sorted(ep_group_ranks), cost.profiles) if n > 1 else None
    routed_bytes = n * t * m.moe_router_topk * cost.token_bytes()  # an emulated all-to-all's payload

    def a2a_time(rows: list[list[float]]) -> float:
        return routed_a2a_time(links, routed_bytes, rows) if links is not None else 0.0

    hidden = gpt.config.hidden_size
    device = rank_device()  # of the all-reduces in synced()
    # last: when this rank's previous window closed (its next window's inputs are there); a2a:
    # each (layer, dispatch?) all-to-all's emulated seconds, for its backward
    st = {"last": time.perf_counter(), "seg": 0.0, "calls": 0, "pending": None, "bseg": 0.0, "bstart": None,
          "mb": -1, "tokens": 0, "received": {}, "a2a": {}}

    def experts_budget(layer: int, bwd: bool) -> float:
        """Emulated seconds of this rank's experts of `layer` for what they received in the
        current microbatch (balanced: `expert`)."""
        from megatron_hetermoe.planner.simulator import experts_time

        got = st["received"].get(layer)
        if got is None:
            return expert[bwd]
        mean = len(ep_group_ranks) * st["tokens"] * topk / m.num_experts
        return experts_time(cost, gpu, [per_expert * (c / mean) if mean > 0 else 0.0 for c in got], bwd)

    def experts_received(layer: int):
        def hook(mod, args):
            counts = args[1]  # tokens_per_expert: this rank's local experts, on the host here
            st["received"][layer] = [int(c) for c in (counts.tolist() if torch.is_tensor(counts) else counts)]
        return hook
    if clock is not None:
        clock.on_step_begin = lambda t0: st.update(last=t0)

    def close(lane: str, kind: str, layer: int, start: float, budget: float) -> float:
        real_end = time.perf_counter()
        sleep_until(start + budget)
        end = time.perf_counter()
        if clock is not None:
            clock.window(lane, (kind, layer, st["mb"]), start, budget, real_end, end)
        if recorder is not None:
            recorder.record(lane, kind, layer, st["mb"], start, end)
        st["last"] = end
        return end

    def synced(ready: float) -> float:
        """When the last rank of the EP group could have started this window."""
        if sync_group is None or dist.get_world_size(sync_group) == 1:
            return ready
        x = torch.tensor([ready], dtype=torch.float64, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=sync_group)
        return float(x.item())

    def synced_rows(ready: float, rows: int, splits) -> tuple[float, list[list[float]]]:
        """synced(ready), and every EP rank's split sizes of this all-to-all (the rows it sends
        each rank; None: even splits of its `rows`), in one gather."""
        mine = [float(x) for x in splits] if splits is not None else [rows / n] * n
        if len(mine) != n:
            raise RuntimeError(f"a token all-to-all split over {len(mine)} ranks in an EP group of {n}: the "
                               f"emulation prices EP without tensor parallelism only")
        if sync_group is None or dist.get_world_size(sync_group) == 1:
            return ready, [mine]
        x = torch.tensor([ready, *mine], dtype=torch.float64, device=device)
        got = [torch.empty_like(x) for _ in range(dist.get_world_size(sync_group))]
        dist.all_gather(got, x, group=sync_group)
        table = torch.stack(got).tolist()
        return max(r[0] for r in table), [r[1:] for r in table]

    def mb_start(mod, args):
        st.update(seg=synced(st["last"]), calls=0, pending=None, mb=st["mb"] + 1, received={})

    def count_tokens(mod, args, kwargs):  # this rank's tokens of the microbatch (the experts' mean)
        ids = args[0] if args else kwargs["input_ids"]
        st["tokens"] = ids.numel()

    def bwd_call(layer: int, dispatch: bool):  # gradient of an all-to-all's output is ready
        if dispatch:
            close("compute", TaskKind.E_B, layer, st["bseg"], experts_budget(layer, True) * scale())
        else:
            close("compute", TaskKind.A_B, layer + 1, st["bseg"], stage[True][layer + 1] * scale())
        st["bstart"] = (layer, dispatch, synced(st["last"]))

    def bwd_return():  # the reverse all-to-all produced the input's gradient
        layer, dispatch, start = st["bstart"]
        st["bseg"] = close("combine" if dispatch else "dispatch", TaskKind.D_B if dispatch else TaskKind.C_B,
                           layer, start, st["a2a"][(layer, dispatch)] * scale())

    orig = token_dispatcher.all_to_all()

    def timed_all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None, **kw):
        # kw: megatron-core 0.19 also passes use_nccl_stream= (compat.py)
        if input_.dim() != 2 or input_.shape[-1] != hidden:
            # The probabilities ride in the dispatch's window.
            out = orig(group, input_, output_split_sizes, input_split_sizes, **kw)
            if st["pending"] is not None:
                layer, start = st["pending"]
                st.update(pending=None, seg=close("dispatch", TaskKind.D_F, layer, start,
                                                  st["a2a"][(layer, True)] * scale()))
            return out
        k = st["calls"]
        st["calls"] = k + 1
        layer, dispatch = k // 2, k % 2 == 0
        if dispatch:
            close("compute", TaskKind.A_F, layer, st["seg"], stage[False][layer] * scale())
        else:
            close("compute", TaskKind.E_F, layer, st["seg"], experts_budget(layer, False) * scale())
        start, rows = synced_rows(st["last"], input_.shape[0], input_split_sizes)
        st["a2a"][(layer, dispatch)] = a2a_time(rows)
        x = _Mark.apply(input_, bwd_return) if input_.requires_grad else input_
        out = orig(group, x, output_split_sizes, input_split_sizes, **kw)
        if dispatch:
            st["pending"] = (layer, start)
        else:
            st["seg"] = close("combine", TaskKind.C_F, layer, start, st["a2a"][(layer, False)] * scale())
        return _Mark.apply(out, lambda: bwd_call(layer, dispatch)) if out.requires_grad else out

    def backward_start():  # the loss's gradient reached the head; the loss ran in this window
        st["bseg"] = synced(st["last"])

    def head_done(mod, args, out):
        close("compute", TaskKind.A_F, L, st["seg"], stage[False][L] * scale())
        first = out[0] if isinstance(out, tuple) else out
        first = _Mark.apply(first, backward_start)
        return (first,) + tuple(out[1:]) if isinstance(out, tuple) else first

    def embedding_done(mod, args, out):
        return _Mark.apply(out, lambda: close("compute", TaskKind.A_B, 0, st["bseg"], stage[True][0] * scale()))

    handles = [gpt.embedding.register_forward_pre_hook(mb_start),
               gpt.embedding.register_forward_pre_hook(count_tokens, with_kwargs=True),
               gpt.embedding.register_forward_hook(embedding_done),
               gpt.output_layer.register_forward_hook(head_done)]
    handles += [layer.mlp.experts.register_forward_pre_hook(experts_received(i))
                for i, layer in enumerate(gpt.decoder.layers)]
    restore = token_dispatcher.replace_all_to_all(timed_all_to_all)

    def undo():
        restore()
        for h in handles:
            h.remove()
        if clock is not None:
            clock.on_step_begin = None

    return undo


def routed_a2a_time(links, routed_bytes: float, rows: list[list[float]]) -> float:
    """Seconds of an emulated token all-to-all in which EP rank i sent rows[i][j] rows to EP rank j
    (the group's rank order, `links`' order): the rows scaled so that they carry `routed_bytes` in
    all (the emulated microbatch's tokens x top-k), priced by planner/cluster.collective_time. Rows
    a rank keeps cost nothing; even rows give planner/baselines.ep_a2a_time."""
    from megatron_hetermoe.planner.cluster import collective_time

    total = sum(map(sum, rows))
    if total <= 0:
        return 0.0
    per_row = routed_bytes / total
    return collective_time(links, [[r * per_row for r in row] for row in rows])


def ep_sync_groups(ep_group_ranks: list[int]):
    """One extra process group per Megatron EP group, for the all-to-all call times (collective:
    every rank passes the ranks of its own EP group); returns this rank's."""
    import torch.distributed as dist

    from megatron_hetermoe.parallel.device import group_timeout

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(ep_group_ranks))
    mine = None
    for ranks in sorted({tuple(r) for r in everyone}):
        g = dist.new_group(list(ranks), timeout=group_timeout())
        if tuple(sorted(ep_group_ranks)) == ranks:
            mine = g
    return mine


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `cb` (a stretch point inside the backward pass)."""

    @staticmethod
    def forward(ctx, x, cb):
        ctx.cb = cb
        return x.clone()  # a view would break in-place ops downstream (bias-dropout-add)

    @staticmethod
    def backward(ctx, g):
        ctx.cb()
        return g, None
