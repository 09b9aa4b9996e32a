"""Event simulator of one HeterMoE training step (zebra or DistEP), running the task lists of
`plan.tasks` rank by rank.

Semantics (the same in the C++ core, csrc/simulator.cpp):
  * every rank walks its list in order; compute tasks run one at a time: a compute task starts
    when the previous compute task of that rank has ended and the comm task it waits for
    (`plan.tasks.inputs`) has ended;
  * a comm task is issued when the rank reaches it in its list (the end of the previous compute
    task: the moment its send buffer exists); issuing does not block the rank;
  * a comm task is one all_to_all over all members of the ZP group, on its stream (dispatch or
    combine); it starts when every member has issued it and the stream is free, and lasts the
    transfer time of its most loaded rank (cluster.rank1_collective_time); with expert
    recompute 'resend-inputs' (cost_model.EXPERT_RECOMPUTE) C_B also carries the routed tokens
    again, twice D_F's bytes;
  * expert tasks' backward (X_B/E_B) re-runs the expert forward unless expert recompute is 'off'
    (cost.expert_time).
After the last task: gradient all-reduce (attention weights over all attention ranks, each
expert over its replicas in the other groups) and the optimizer step, not overlapped.

All ZP groups are alike, so one group is simulated. Ranks of a group that are indistinguishable
(same role, GPU type and experts per layer) behave identically; `dedup=True` simulates one of
each, which changes no time (a collective waits for the latest issuer, and twins issue together).
"""
from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.plan.tasks import (
    PipeTask,
    Task,
    distep_tasks,
    inputs,
    offloaded_layers_of,
    stage_transfers,
    task_layers,
    zebra_tasks,
)
from megatron_hetermoe.planner.cluster import (
    Cluster,
    Links,
    allreduce_time,
)
from megatron_hetermoe.planner.cost_model import CostModel
from megatron_hetermoe.planner.expert_load import ExpertLoad
from megatron_hetermoe.planner.pipeline import (
    PipelineResult,
    check_plan_matches,
    layer_collectives,
    layout_of_plan,
    p2p_time,
    post_step,
    simulate_pipelined,
)
from megatron_hetermoe.vocabulary import Role, ScheduleName, TaskKind

STREAM_ID = {"dispatch": 0, "combine": 1, TaskKind.P_F: 2, TaskKind.P_B: 3}  # per pipeline stage: stage * 4 + this
CSIM_ABI = 2  # the _csim.run arguments this module passes (csrc/simulator.cpp's ABI)


@dataclass
class SimProblem:
    """One group's step, flattened for the engines. Ranks here are representatives."""

    ranks: list[int]  # plan rank of each representative
    multiplicity: list[int]  # how many plan ranks each representative stands for
    roles: list[str]
    gpus: list[str]
    tasks: list[list[Task]]
    is_comm: list[list[int]]  # 1 for a comm task
    dur: list[list[float]]  # compute duration (0 for comm)
    ref: list[list[int]]  # comm: collective id; compute: id of the collective it waits for, or -1
    coll_tasks: list[Task] = field(default_factory=list)
    coll_stream: list[int] = field(default_factory=list)
    coll_dur: list[float] = field(default_factory=list)
    coll_members: list[int] = field(default_factory=list)  # ranks (representatives) that issue it; empty: all
    post_step: list[float] = field(default_factory=list)  # per representative: grad sync + optimizer
    tokens_per_step: float = 0.0
    _flat: tuple | None = field(default=None, repr=False)  # cache of flat_arrays()


@dataclass
class SimTrace:
    start: list[list[float]]
    end: list[list[float]]
    coll_start: list[float]
    coll_end: list[float]


@dataclass
class SimResult:
    step_time_s: float
    tokens_per_s: float
    makespan_s: float  # the task lists alone, before grad sync and optimizer
    utilization: dict[str, float]  # GPU type -> mean fraction of the step its compute stream is busy
    problem: SimProblem | None = None
    trace: SimTrace | None = None

    def trace_of(self, rank: int) -> list[tuple[Task, float, float]]:
        """(task, start, end) in list order for a plan rank (needs dedup=False or a representative)."""
        assert self.problem is not None and self.trace is not None
        i = self.problem.ranks.index(rank)
        return list(zip(self.problem.tasks[i], self.trace.start[i], self.trace.end[i]))


# ---------------------------------------------------------------- engine (reference)
def run_python(p: SimProblem) -> SimTrace:
    n = len(p.tasks)
    nc = len(p.coll_dur)
    issued = [0] * nc
    issue_max = [0.0] * nc
    cstart = [0.0] * nc
    cend = [-1.0] * nc
    members = p.coll_members or [n] * nc
    stream_free = [0.0] * (max(p.coll_stream, default=-1) + 1)
    pc = [0] * n
    host = [0.0] * n
    start = [[0.0] * len(t) for t in p.tasks]
    end = [[0.0] * len(t) for t in p.tasks]
    remaining = sum(len(t) for t in p.tasks)
    while remaining:
        progress = False
        for r in range(n):
            is_comm, dur, ref = p.is_comm[r], p.dur[r], p.ref[r]
            i, h, m = pc[r], host[r], len(is_comm)
            while i < m:
                c = ref[i]
                if is_comm[i]:
                    issued[c] += 1
                    if h > issue_max[c]:
                        issue_max[c] = h
                    if issued[c] == members[c]:  # last member issued: all earlier ones on its stream are resolved
                        s = p.coll_stream[c]
                        t0 = max(issue_max[c], stream_free[s])
                        cstart[c], cend[c] = t0, t0 + p.coll_dur[c]
                        stream_free[s] = cend[c]
                else:
                    if c >= 0:
                        if cend[c] < 0:
                            break
                        if cend[c] > h:
                            h = cend[c]
                    start[r][i] = h
                    h += dur[i]
                    end[r][i] = h
                i += 1
                remaining -= 1
                progress = True
            pc[r], host[r] = i, h
        if not progress:
            blocked = {p.ranks[r]: p.tasks[r][pc[r]] for r in range(n) if pc[r] < len(p.tasks[r])}
            raise RuntimeError(f"task lists deadlock: each rank waits at {blocked}; the lists do not "
                               f"issue collectives in one order (plan.tasks.check_stream_order)")
    for r in range(n):  # comm tasks: the collective's own times
        for i, t in enumerate(p.is_comm[r]):
            if t:
                c = p.ref[r][i]
                start[r][i], end[r][i] = cstart[c], cend[c]
    return SimTrace(start, end, cstart, cend)


def flat_arrays(p: SimProblem) -> tuple:
    """The problem as the C++ core takes it (numpy arrays; built once per problem)."""
    if p._flat is None:
        import numpy as np

        offsets = np.zeros(len(p.tasks) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(t) for t in p.tasks])

        def cat(rows, dt):
            return np.array(list(chain.from_iterable(rows)), dtype=dt)

        p._flat = (offsets, cat(p.is_comm, np.int64), cat(p.dur, np.float64), cat(p.ref, np.int64),
                   np.asarray(p.coll_stream, dtype=np.int64), np.asarray(p.coll_dur, dtype=np.float64),
                   np.asarray(p.coll_members or [len(p.tasks)] * len(p.coll_dur), dtype=np.int64))
    return p._flat


def run_cpp(p: SimProblem) -> SimTrace:
    from megatron_hetermoe import _csim  # built by setup.py from csrc/simulator.cpp

    flat = flat_arrays(p)
    offsets = flat[0].tolist()
    st, en, cs, ce = (a.tolist() for a in _csim.run(*flat))
    start = [st[offsets[r]:offsets[r + 1]] for r in range(len(p.tasks))]
    end = [en[offsets[r]:offsets[r + 1]] for r in range(len(p.tasks))]
    return SimTrace(start, end, cs, ce)


@functools.lru_cache(maxsize=None)
def have_cpp() -> bool:
    try:
        mod = importlib.import_module("megatron_hetermoe._csim")
    except ImportError:
        return False
    return getattr(mod, "ABI", 1) == CSIM_ABI  # a build from before run() took coll_members is stale


@functools.lru_cache(maxsize=None)
def _python_fallback_notice() -> None:
    print("hetermoe: the C++ simulator (megatron_hetermoe._csim) is not built (or built from an older "
          "csrc/simulator.cpp); the planner uses the pure-Python simulator (same results, slower). Reinstall "
          "with a C++ compiler to build it.",
          file=sys.stderr, flush=True)


def run(p: SimProblem, engine: str = "auto") -> SimTrace:
    if engine == "python":
        return run_python(p)
    if engine == "auto" and not have_cpp():
        _python_fallback_notice()
        return run_python(p)
    if engine in ("cpp", "auto"):
        return run_cpp(p)
    raise ValueError(f"engine {engine!r} is not 'auto', 'python' or 'cpp'")


# ---------------------------------------------------------------- building a group's problem
def tokens_per_microbatch(plan: HeteroPlan, global_tokens: float) -> float:
    """Tokens one attention rank processes per microbatch (its stage's share: every stage sees
    every token)."""
    per_stage = len(plan.groups[0].attention_ranks) // plan.pipeline_stages
    return global_tokens / (len(plan.groups) * per_stage * plan.num_microbatches)


def compute_task_time(cost: CostModel, gpu: str, task: Task, tokens_per_microbatch: float,
                      experts_held: int = 0, tokens_per_expert: float = 0.0, attention_tp: int = 1,
                      attention_cp: int = 1) -> float:
    """Seconds of one compute task of the task list on a GPU type: A_* is attention stage
    `task.layer` on `tokens_per_microbatch` tokens (the rank's; under attention_tp x attention_cp
    its share of the member's, and the stage's TP collectives and CP K/V exchanges are in its
    time: cost.stage_time); X_*/E_* run
    `experts_held` experts of that layer, each on `tokens_per_expert` routed tokens (balanced
    routing: M * tokens * topk / E)."""
    if task.is_comm:
        raise ValueError(f"{task} is a comm task; its time comes from cluster.rank1_collective_time")
    bwd = task.kind.endswith("_B")
    if task.kind[0] == "A":
        return cost.stage_time(gpu, task.layer, tokens_per_microbatch, bwd, attention_tp, cp=attention_cp)
    return experts_held * cost.expert_time(gpu, tokens_per_expert, bwd)


def experts_time(cost: CostModel, gpu: str, tokens: list[float] | tuple[float, ...], backward: bool) -> float:
    """Seconds of one X/E task running one expert per entry of `tokens` (the tokens each
    received), one after another. Equal counts are priced once and multiplied, so a balanced
    load gives exactly compute_task_time's n * expert_time."""
    groups: dict[float, int] = {}
    for t in tokens:
        groups[t] = groups.get(t, 0) + 1
    return sum(n * cost.expert_time(gpu, t, backward) for t, n in groups.items())


def balanced_tokens_per_expert(plan: HeteroPlan, cost: CostModel, global_batch: int) -> float:
    """Routed tokens each expert of a layer gets per microbatch under balanced routing: the
    stage's attention ranks' tokens x top-k over the experts."""
    t_mb = tokens_per_microbatch(plan, float(global_batch) * cost.settings.seq_len)
    M_stage = len(plan.stage_ranks(0, 0)[0])
    return M_stage * t_mb * cost.model.moe_router_topk / plan.num_experts


def rank_task_times(plan: HeteroPlan, cost: CostModel, cluster: Cluster, global_batch: int, rank: int,
                    schedule: str | None = None, with_transfers: bool = False,
                    expert_load: ExpertLoad | None = None) -> list[tuple[Task | PipeTask, float]]:
    """The task list of `rank` with each task's predicted seconds (compute: on the rank's GPU
    type; comm: the collective's transfer time). For emulating a mixed cluster: stretch each
    compute task to its time; compare measured step times with simulate_plan's. The runtime's
    list has no stage transfers (PipeTask: it does them at the attention tasks that produce or
    consume them); `with_transfers` keeps them where plan.tasks.stage_transfers puts them.
    `expert_load`: price expert tasks and transfers for these loads (build_problem)."""
    p = build_problem(plan, cost, cluster, global_batch, schedule, group=plan.group_of(rank), dedup=False,
                      expert_load=expert_load)
    i = p.ranks.index(rank)
    return [(t, p.coll_dur[ref] if c else d) for t, c, d, ref in zip(p.tasks[i], p.is_comm[i], p.dur[i], p.ref[i])
            if with_transfers or not isinstance(t, PipeTask)]


@dataclass(frozen=True, slots=True)
class _ListShape:
    """A rank's task list, its stage transfers inserted, reduced to what build_problem prices per
    rank: which collectives it issues and waits for, and which compute it runs."""

    tasks: tuple[Task | PipeTask, ...]
    is_comm: tuple[int, ...]
    colls: tuple[Task | PipeTask, ...]  # the collectives the list names, in first-use order
    # their keys in the problem: a stage's collective by its stage, a transfer (its sender and
    # receiver are on two stages) by -1; a tuple hashes far faster than the dataclass
    coll_keys: tuple[tuple, ...]
    issues: tuple[int, ...]  # per colls entry: how many of the list's comm tasks issue it
    ref: tuple[int, ...]  # per task: its colls entry (comm: the one it issues; compute: the one it waits for) or -1
    work: tuple[Task, ...]  # one compute task per (kind, layer, chunk) the list runs: what prices it
    work_of: tuple[int, ...]  # per task: its work entry, or -1 for a comm task


def _with_transfers(tasks: list[Task], stage: int, stages: int, n_local: tuple[int, ...]) -> tuple[list, dict]:
    """An attention rank's list with plan.tasks.stage_transfers inserted, and the transfer each
    compute task waits for (by list index): a stage's first piece, its last piece's backward."""
    tl: list[Task | PipeTask] = []
    received: dict[int, PipeTask] = {}
    for t in tasks:
        recv, send = stage_transfers(t, stage, stages, n_local)
        if recv is not None:
            tl.append(recv)
            received[len(tl)] = recv
        tl.append(t)
        if send is not None:
            tl.append(send)
    return tl, received


def _shape_of(tasks: list[Task], stage: int, stages: int, n_local: tuple[int, ...], transfers: bool) -> _ListShape:
    """The shape of a list of pipeline stage `stage` with `n_local` MoE layers per chunk;
    `transfers`: insert the stage transfers (an attention rank with pipeline stages)."""
    tl, received = _with_transfers(tasks, stage, stages, n_local) if transfers else (tasks, {})
    local: dict[tuple, int] = {}  # coll_keys' key -> its index
    colls, keys, issues, ref, is_comm = [], [], [], [], []
    work: dict[tuple, int] = {}  # (kind, layer, chunk) -> its index
    first, work_of = [], []

    def coll(t: Task | PipeTask) -> int:
        key = (-1 if isinstance(t, PipeTask) else stage, t.kind, t.layer, t.microbatch)
        if key not in local:
            local[key] = len(colls)
            colls.append(t)
            keys.append(key)
            issues.append(0)
        return local[key]

    for n_t, t in enumerate(tl):
        is_comm.append(int(t.is_comm))
        if t.is_comm:
            ref.append(coll(t))
            issues[ref[-1]] += 1
            work_of.append(-1)
            continue
        dep = inputs(t, n_local) or received.get(n_t)
        ref.append(coll(dep) if dep is not None else -1)
        w = work.setdefault((t.kind, t.layer, t.chunk), len(first))
        if w == len(first):
            first.append(t)
        work_of.append(w)
    return _ListShape(tuple(tl), tuple(is_comm), tuple(colls), tuple(keys), tuple(issues), tuple(ref), tuple(first),
                      tuple(work_of))


_SHAPES: dict[tuple, _ListShape] = {}  # _list_shape's, by what a list depends on
_SHAPES_MAX_TASKS = 1_000_000  # about 160 MB of lists; a 1024-GPU search keeps 143k tasks (71 lists)


def _list_shape(plan: HeteroPlan, schedule: str, lister: Callable[[HeteroPlan, int], list[Task]], rank: int,
                stage: int, role: Role) -> _ListShape:
    """The shape of `rank`'s list (lister: plan.tasks' zebra_tasks or distep_tasks), built once
    per key: the list depends on the rank only through its role, stage and offloaded layers, and
    on the plan only through its microbatches, stages, waves and the stage's MoE layers per chunk,
    so ranks, groups and the candidates of a search share it."""
    n_local = task_layers(plan, stage)
    off = frozenset(offloaded_layers_of(plan, rank)) if role == Role.ATTENTION else frozenset()
    P = plan.pipeline_stages
    key = (schedule, role, stage, off, n_local, plan.num_layers, plan.num_microbatches, P, plan.zebra_waves,
           plan.zebra_wave_order)
    shape = _SHAPES.get(key)
    if shape is None:
        if sum(len(s.tasks) for s in _SHAPES.values()) > _SHAPES_MAX_TASKS:
            _SHAPES.clear()
        shape = _SHAPES[key] = _shape_of(lister(plan, rank), stage, P, n_local, P > 1 and role == Role.ATTENTION)
    return shape


def build_problem(plan: HeteroPlan, cost: CostModel, cluster: Cluster, global_batch: int,
                  schedule: str | None = None, group: int = 0, dedup: bool = True,
                  expert_load: ExpertLoad | None = None) -> SimProblem:
    """The task lists and durations of ZP group `group` for a global batch of `global_batch`
    sequences of cost.settings.seq_len tokens.

    With pipeline stages (zebra only: DistEP there is Megatron's 1F1B, priced by
    planner/pipeline.py) each stage's ranks run their stage's lists (plan.tasks.zebra_tasks) and
    its collectives are over the stage's members, on the stage's own dispatch and combine
    streams. Stages meet through PipeTasks: a stage before the last sends microbatch j's output
    at the end of its last attention piece A_F(L_i, j), and the next stage's A_F(0, j) waits for
    it; the gradient comes back from that stage's A_B(0, j) to A_B(L_i, j). A receiver issues the
    transfer when it reaches the task that waits for it (a send waits for its receive). The
    attention pieces are planner/pipeline.py's (stage_pieces): the last piece of a stage before
    the last does no compute (dense layers after the stage's last MoE layer are priced with that
    layer's piece); the post-step is pipeline.post_step's. With virtual stages each model chunk's
    A tasks are its virtual stage's pieces (pipeline.layout_of_plan's chunk_pieces), the last
    stage's chunks send on to the first stage's next chunk over that pair's link, and a stage's
    transfers of all its chunks share its links (streams).

    `expert_load` (a measured per-layer histogram, planner/expert_load.py; None: balanced): each
    expert of a layer gets the balanced share times its multiplier (its tokens over the layer's
    mean), so an X/E task costs its experts' own token counts (experts_time) and a member's share
    of a layer's dispatch and combine bytes is its experts' multipliers summed (where balanced
    routing has their count)."""
    P = plan.pipeline_stages
    schedule = schedule or plan.schedule
    lister = {"zebra": zebra_tasks, "distep": distep_tasks}.get(schedule)
    if lister is None:
        raise PlanError(f"schedule {schedule!r} is unknown; use 'zebra' or 'distep'")
    if P > 1 and schedule != ScheduleName.ZEBRA:
        raise PlanError(f"schedule {schedule!r} with pipeline_stages={P} has no task lists (DistEP runs Megatron's "
                        f"1F1B there); simulate_plan prices it with the 1F1B step model (planner/pipeline.py)")
    m = cost.model
    check_plan_matches(plan, cluster, m)  # L counts MoE layers; the dense ones run inside attention stages
    E, k = plan.num_experts, m.moe_router_topk
    g = plan.groups[group]
    G = len(plan.groups)
    V = plan.virtual_stages
    lay = layout_of_plan(plan, validate=False, virtual=True) if P > 1 else None
    global_tokens = float(global_batch) * cost.settings.seq_len
    t_mb = tokens_per_microbatch(plan, global_tokens)
    stage = {r: plan.stage_of(r) for r in g.members}
    role = {r: plan.role(r) for r in g.members}
    layers = [plan.stage_moe_layers(i) for i in range(P)]  # a stage's task-list layer k is MoE layer layers[i][k]
    placed = [[g.placement[l] for l in ls] for ls in layers]  # [stage][k]: rank -> its experts
    counts = {r: [len(pl.get(r, ())) for pl in placed[stage[r]]] for r in g.members}
    load_mult = None
    if expert_load is not None:
        expert_load.check(plan.num_layers, E, "the expert load")
        load_mult = [expert_load.multipliers(l) for l in range(plan.num_layers)]
    # a member's weight in a layer's transfers: its experts' count, or their multipliers' sum
    weight = counts if load_mult is None else {
        r: [sum(load_mult[l][e] for e in g.placement[l].get(r, [])) for l in layers[stage[r]]] for r in g.members}

    # collectives: one per (stage, kind, layer, microbatch); durations from the bipartite byte matrix
    layer_dur: list[list[dict]] = []  # [stage][k]
    for i in range(P):
        att, exp = plan.stage_ranks(group, i)
        held = list(zip(*(weight[r] for r in att + exp)))  # per layer: each member's weight
        layer_dur.append(layer_collectives(cost, cluster, att + exp, len(att), held, t_mb))
    # between stage b and b + 1 (virtual stages: P - 1 and 0 too): (b, False) the activations
    # forward, (b, True) their gradient back
    p2p = {(b, bwd): p2p_time(lay, cost, cluster, b, t_mb, bwd) for b in range(P if V > 1 else P - 1)
           for bwd in (False, True)}

    # representatives
    keys: dict[tuple, int] = {}
    reps: list[int] = []
    mult: list[int] = []
    for r in g.members:
        key = (stage[r], role[r], plan.gpu_types[r],
               tuple(weight[r] if load_mult is None else
                     [tuple(g.placement[l].get(r, [])) for l in layers[stage[r]]]))
        key = key if dedup else (r,)
        if key in keys:
            mult[keys[key]] += 1
        else:
            keys[key] = len(reps)
            reps.append(r)
            mult.append(1)

    prob = SimProblem(ranks=reps, multiplicity=mult, roles=[role[r] for r in reps],
                      gpus=[plan.gpu_types[r] for r in reps], tasks=[], is_comm=[], dur=[], ref=[],
                      tokens_per_step=global_tokens)
    coll_id: dict[tuple, int] = {}  # by _ListShape.coll_keys' key

    def cid(key: tuple, t: Task | PipeTask) -> int:
        c = coll_id.get(key)
        if c is None:
            c = coll_id[key] = len(prob.coll_dur)
            prob.coll_tasks.append(t)
            prob.coll_members.append(0)
            if isinstance(t, PipeTask):  # keyed by the sending (virtual) stage, streamed by its pipeline stage
                prob.coll_stream.append(4 * (t.layer % P) + STREAM_ID[t.kind])
                back = t.kind == TaskKind.P_B
                prob.coll_dur.append(p2p[((t.layer - back) % P, back)])
            else:  # keyed by its stage
                prob.coll_stream.append(4 * key[0] + STREAM_ID[t.stream])
                prob.coll_dur.append(layer_dur[key[0]][t.layer][t.kind])
        return c

    M_stage = len(plan.stage_ranks(group, 0)[0])
    per_expert_tokens = M_stage * t_mb * k / E  # balanced routing: every expert gets the same share
    cache: dict[tuple, float] = {}

    def compute_dur(r: int, t: Task) -> float:
        i = stage[r]
        if load_mult is not None and t.kind[0] in "XE":  # the experts' own loads
            l = layers[i][t.layer]
            key = (plan.gpu_types[r], t.kind, l, tuple(g.placement[l].get(r, [])))
            if key not in cache:
                cache[key] = experts_time(cost, plan.gpu_types[r],
                                          [per_expert_tokens * load_mult[l][e] for e in key[3]],
                                          t.kind.endswith("_B"))
            return cache[key]
        held = counts[r][t.layer] if t.kind[0] in "XE" else 0
        key = (plan.gpu_types[r], i, t.kind, t.layer, t.chunk, held)
        if key not in cache:
            pieces = None if lay is None else lay.chunk_pieces[t.chunk * P + i] if V > 1 else lay.pieces[i]
            if lay is None or t.kind[0] != "A":
                cache[key] = compute_task_time(cost, plan.gpu_types[r], t, t_mb, key[5], per_expert_tokens,
                                               plan.attention_tp, plan.attention_cp)
            elif t.layer < len(pieces):  # the (chunk's) piece t.layer (its last only on the last virtual stage)
                s, d = pieces[t.layer]
                cache[key] = cost.stage_time(plan.gpu_types[r], s, t_mb, t.kind == TaskKind.A_B, plan.attention_tp,
                                             dense=d, cp=plan.attention_cp)
            else:  # a stage's last piece before the last stage: only the send of its output
                cache[key] = 0.0
        return cache[key]

    for r in reps:
        shape = _list_shape(plan, schedule, lister, r, stage[r], role[r])
        ids = list(map(coll_id.get, shape.coll_keys))
        if None in ids:  # the list names collectives no list before it did
            ids = [cid(key, t) for key, t in zip(shape.coll_keys, shape.colls)]
        for c, n in zip(ids, shape.issues):
            prob.coll_members[c] += n
        ids.append(-1)  # a ref of -1 (waits for nothing) indexes this last entry: stays -1
        durs = [compute_dur(r, t) for t in shape.work] + [0.0]  # a comm task's work index -1: 0 s
        prob.tasks.append(list(shape.tasks))
        prob.is_comm.append(list(shape.is_comm))
        prob.dur.append(list(map(durs.__getitem__, shape.work_of)))
        prob.ref.append(list(map(ids.__getitem__, shape.ref)))

    if lay is not None:
        prob.post_step = [post_step(lay, cost, cluster)] * len(reps)  # stages step at once; the slowest counts
        return prob
    # after the lists: grad all-reduce and optimizer step, per representative (an attention rank's
    # non-expert parameters include dense layers' MLPs and shared experts). Under attention_tp the
    # dense gradients are all-reduced over the members (rank i of every member: its shard of them,
    # non_expert_params_per_rank) and each rank steps its shard; under attention_cp the ranks at
    # one TP position of every member (data x context parallel, Megatron's dp-cp group) all-reduce
    # the whole weights' gradients (CP replicates them): with TP fastest in a member, every tp-th rank.
    members = g.members
    tp = plan.attention_tp
    attn_all = plan.attention_ranks
    grad_bytes = cost.settings.dtype_bytes
    dense_params = cost.non_expert_params_per_rank(tp)
    for r in reps:
        n_exp = sum(counts[r])
        params = m.expert_params() * n_exp
        t = 0.0
        if role[r] == Role.ATTENTION:
            pos = g.attention_ranks.index(r) % tp  # the rank's place in its member
            dp_group = attn_all[pos::tp]
            t += allreduce_time(Links.for_ranks(cluster, dp_group, cost.profiles), dense_params * grad_bytes)
            params += dense_params
        if G > 1 and n_exp:
            k_in_group = members.index(r)
            replicas = [plan.groups[gi].members[k_in_group] for gi in range(G)]
            t += allreduce_time(Links.for_ranks(cluster, replicas, cost.profiles),
                                m.expert_params() * n_exp * grad_bytes)
        t += cost.optimizer_time(plan.gpu_types[r], params)
        prob.post_step.append(t)
    return prob


def result_of(p: SimProblem, tr: SimTrace, keep: bool = False) -> SimResult:
    finish = [max(e) if e else 0.0 for e in tr.end]
    makespan = max(finish + tr.coll_end + [0.0])
    step = makespan + max(p.post_step + [0.0])
    busy: dict[str, list[float]] = {}
    for i, gpu in enumerate(p.gpus):
        b = sum(d for d, c in zip(p.dur[i], p.is_comm[i]) if not c)
        busy.setdefault(gpu, []).extend([b] * p.multiplicity[i])
    util = {gpu: (sum(v) / len(v)) / step if step > 0 else 0.0 for gpu, v in busy.items()}
    return SimResult(step, p.tokens_per_step / step if step > 0 else 0.0, makespan, util,
                     p if keep else None, tr if keep else None)


def simulate_plan(plan: HeteroPlan, cost: CostModel, cluster: Cluster, global_batch: int,
                  schedule: str | None = None, engine: str = "auto", dedup: bool = True,
                  keep_trace: bool = False, expert_load: ExpertLoad | None = None) -> SimResult | PipelineResult:
    """Predicted step of `plan` (its own schedule unless `schedule` is given). With pipeline
    stages (pipeline_stages > 1) zebra runs its stages' task lists here (build_problem); DistEP
    is priced by planner/pipeline.py's model (Megatron's 1F1B across the stages; a
    PipelineResult, which has no trace: keep_trace is refused). `expert_load`: measured loads
    (build_problem)."""
    if plan.pipeline_stages != 1 and (schedule or plan.schedule) == ScheduleName.DISTEP:
        if expert_load is not None:
            raise PlanError(f"plan has pipeline_stages={plan.pipeline_stages} under DistEP, priced by the 1F1B step "
                            f"model, which takes no expert load yet; simulate zebra, or drop the expert load")
        if keep_trace:
            raise PlanError(f"plan has pipeline_stages={plan.pipeline_stages} under DistEP: there are no task lists to "
                            f"trace (the 1F1B model prices whole stages); drop keep_trace")
        return simulate_pipelined(plan, cost, cluster, global_batch, schedule)
    p = build_problem(plan, cost, cluster, global_batch, schedule, dedup=dedup, expert_load=expert_load)
    return result_of(p, run(p, engine), keep_trace)


# The baselines' step models live in baselines.py (no task lists there); re-exported here so that
# every strategy the planner compares is reachable from the simulator module.
from megatron_hetermoe.planner.baselines import (  # noqa: E402,F401
    physical_limit,
    simulate_ep,
    simulate_ep_ideal,
    simulate_hetero_pp,
)

BASELINES = (physical_limit, simulate_ep, simulate_ep_ideal, simulate_hetero_pp)  # the re-exported step models
