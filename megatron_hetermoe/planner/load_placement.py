"""Load-aware expert placement (issue 46 item 3): which rank of a ZP group holds which expert of
each MoE layer when the router is not uniform (a measured ExpertLoad, planner/expert_load.py),
on GPUs of different speeds. It decides Asym-EA (how many of a layer's experts each attention
rank takes) and the expert-to-rank assignment together, within each rank's memory; the plan's
layout (roles, groups, stages, R) stays.

The model is the one Asym-EA's optimal solver scores (asym_ea.objective), each expert priced by
its own load. Member j of a ZP group runs c_j(l, e) = speed[g_j] x (expert_time(g_j, share x
m_le) forward + backward) for expert e of MoE layer l, where share is the balanced routed tokens
per expert and microbatch, m_le the expert's measured multiplier (tokens over the layer's mean)
and speed[g] a measured correction of the cost model for GPU type g (ExpertSpeeds; 1.0: the
profile). With X_jl the sum over the experts j holds and A_jl its attention piece of layer l (0 on
expert ranks), layer l costs
    zebra:  max_j (A_jl + X_jl)          (attention and experts of a layer overlap)
    DistEP: max_j A_jl + max_j X_jl      (the experts wait for the attention)
and J is the sum over layers. Memory of member j: its attention bytes (attention ranks), each held
expert's weights and state plus the routed tokens it keeps for backward (share x m x the level's
bytes per token x live microbatches: CostModel.per_expert_bytes) and the working set of the hottest
expert of the model, within its GPU type's usable memory (pipeline.pipeline_memory's rule, with
loads).

Solver: local search from two starts, the plan's own (uniform) placement and a longest-
processing-time greedy (each layer's experts hottest first, each to the member that would finish
it earliest), each also with the attention ranks kept out of the layers where the plan's own
placement offloads nothing (`candidates`). A step moves one expert of a layer's busiest member to another
member of its stage, or swaps it with an expert there, and is taken when it lowers, in this order,
the bytes over memory, J, or the sum of squared busy times (without that last term a balanced
layer, whose members share the maximum, offers no single step that lowers it).

The simulator is the judge (simulate_plan with the loads): J prices each layer alone, and the
step is not a sum of layers (an expert on an attention rank in the last layer delays every
backward; the transfers follow the hot experts). `place_for_load` simulates each candidate that
fits and writes the fastest only where its predicted step is below the plan's own placement's
under the same loads, so the result is never predicted slower than the uniform placement.

Measured speeds (`measured_speeds`): a stats file's per-rank expert task seconds (X_*, E_*) over
the cost model's seconds for the same tokens on the same ranks (the measured run's plan says which
experts each rank held) give each GPU type a factor; the factors are divided by the run's overall
ratio, so they change the relative speed of the measured types and not the scale of expert time
against attention time (which the measured run, a different shape or program, may not share).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.plan.tasks import wave_warmup
from megatron_hetermoe.planner import pipeline
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel
from megatron_hetermoe.planner.expert_load import ExpertLoad, LoadStats
from megatron_hetermoe.planner.simulator import simulate_plan
from megatron_hetermoe.vocabulary import ScheduleName, TaskKind

# the task kinds that run experts (plan/tasks.py)
EXPERT_KINDS = (TaskKind.X_F, TaskKind.X_B, TaskKind.E_F, TaskKind.E_B)
MAX_PASSES = 200  # local-search passes over the layers (each pass takes every improving step it finds)


# ---------------------------------------------------------------- measured speeds
@dataclass(frozen=True)
class ExpertSpeeds:
    """A factor on the cost model's expert time per GPU type (absent: 1.0, the profile's)."""
    factors: dict[str, float] = field(default_factory=dict)
    source: str = "the GPU profiles"

    def factor(self, gpu: str) -> float:
        return self.factors.get(gpu, 1.0)

    def describe(self) -> str:
        if not self.factors:
            return f"expert speeds: {self.source}"
        return ("expert speeds: " + ", ".join(f"{g} x{f:.3f}" for g, f in sorted(self.factors.items()))
                + f" of the profile's expert time ({self.source})")


class ExpertSpeedCost:
    """A CostModel whose expert_time is scaled per GPU type (ExpertSpeeds); every other price is
    the wrapped model's. The simulator reads expert times through expert_time only."""

    def __init__(self, cost: CostModel, speeds: ExpertSpeeds):
        self._cost, self.speeds = cost, speeds

    def __getattr__(self, name: str):
        return getattr(self._cost, name)

    def expert_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        return self.speeds.factor(gpu) * self._cost.expert_time(gpu, tokens, backward)


def with_speeds(cost: CostModel, speeds: ExpertSpeeds | None):
    """`cost` with its expert times scaled by `speeds` (the model itself where nothing is measured)."""
    return cost if speeds is None or not speeds.factors else ExpertSpeedCost(cost, speeds)


def _window(stats: LoadStats, last_intervals: int | None) -> tuple[int, list[list[float]], list[dict[str, float]]]:
    """(steps, tokens, task seconds per rank) of the whole run or of its last intervals."""
    if not last_intervals:
        return stats.steps, stats.tokens, stats.task_seconds
    got = stats.intervals[-last_intervals:]
    tokens = [[sum(iv["tokens"][l][e] for iv in got) for e in range(stats.num_experts)]
              for l in range(stats.num_layers)]
    secs: list[dict[str, float]] = [{} for _ in range(stats.world_size)]
    for iv in got:
        for mine, add in zip(secs, iv["task_seconds"]):
            for k, s in add.items():
                mine[k] = mine.get(k, 0.0) + s
    return sum(iv["steps"] for iv in got), tokens, secs


def measured_speeds(stats: LoadStats, run_plan: HeteroPlan, cost: CostModel,
                    last_intervals: int | None = None) -> ExpertSpeeds:
    """Per GPU type of `cost`'s profiles: measured expert seconds over the cost model's for the same
    work (module docstring), from the stats of a run on `run_plan`. Types the run did not measure
    keep 1.0; with fewer than two measured types nothing is relative, so every factor is 1.0."""
    if (run_plan.world_size, run_plan.num_layers, run_plan.num_experts) != (
            stats.world_size, stats.num_layers, stats.num_experts):
        raise ValueError(f"the measured run's plan has {run_plan.world_size} ranks, {run_plan.num_layers} MoE layers x "
                         f"{run_plan.num_experts} experts but the stats file {stats.world_size}, {stats.num_layers} x "
                         f"{stats.num_experts}; give the plan that run trained on")
    if [g.lower() for g in run_plan.gpu_types] != [g.lower() for g in stats.gpu_types]:
        raise ValueError(f"the measured run's plan has GPU types {run_plan.gpu_types} but the stats file "
                         f"{stats.gpu_types}; give the plan that run trained on")
    steps, tokens, secs = _window(stats, last_intervals)
    G, R = len(run_plan.groups), run_plan.num_microbatches
    # the run's expert backward re-ran the forward as its plan's level says
    run_cost = CostModel(cost.model, cost.profiles, dataclasses.replace(cost.settings,
                                                                        expert_recompute=run_plan.expert_recompute))
    by_type: dict[str, list[float]] = {}  # gpu -> [measured, predicted]
    known = {g.lower(): g for g in cost.profiles}
    for r, gpu in enumerate(run_plan.gpu_types):
        g = known.get(gpu.lower())
        measured = sum(secs[r].get(k, 0.0) for k in EXPERT_KINDS) if r < len(secs) else 0.0
        if g is None or measured <= 0 or steps <= 0:
            continue
        predicted = 0.0
        for l in range(run_plan.num_layers):
            for e in run_plan.local_experts(r, l):
                t = tokens[l][e] / (steps * G * R)  # this rank's group's share, per microbatch
                predicted += run_cost.expert_time(g, t, False) + run_cost.expert_time(g, t, True)
        if predicted > 0:
            acc = by_type.setdefault(g, [0.0, 0.0])
            acc[0] += measured
            acc[1] += steps * R * predicted
    if len(by_type) < 2:
        what = ", ".join(sorted(by_type)) or "no GPU type of this cluster"
        return ExpertSpeeds({}, f"the GPU profiles (the stats file measured expert tasks on {what}; relative speeds "
                                f"need two types)")
    overall = sum(m for m, _ in by_type.values()) / sum(p for _, p in by_type.values())
    factors = {g: (m / p) / overall for g, (m, p) in by_type.items()}
    return ExpertSpeeds(factors, f"measured: {steps} steps' expert task seconds")


# ---------------------------------------------------------------- the problem
@dataclass
class PlacementProblem:
    """One ZP group's placement problem (module docstring). Member j is the plan's group-0 rank
    members[j]; layer l's experts may sit on holders[l] (member indices of its stage)."""
    members: list[int]
    num_experts: int
    stage: dict[int, list[int]]  # MoE layer -> member indices of its pipeline stage
    holders: dict[int, list[int]]  # MoE layer -> members that may hold its experts
    base: dict[int, list[float]]  # MoE layer -> per stage member: its attention piece's seconds (0: expert rank)
    cost: dict[int, dict[int, list[float]]]  # MoE layer -> holder -> seconds of each expert on it
    overlap: bool  # zebra (True) or DistEP
    capacity: list[float]  # bytes member j may spend on experts (math.inf: unbounded)
    expert_bytes: dict[int, list[float]] = field(default_factory=dict)  # MoE layer -> bytes of each expert held
    work_bytes: float = 0.0  # a holder's working set (the hottest expert's)
    attention: frozenset[int] = frozenset()  # the attention members

    @property
    def layers(self) -> list[int]:
        return sorted(self.stage)

    def layer_time(self, l: int, X: list[float]) -> float:
        """Layer l's cost (module docstring) for experts' seconds X per stage member."""
        b = self.base[l]
        if self.overlap:
            return max(x + y for x, y in zip(b, X))
        return max(b) + max(X)

    def layer_sq(self, l: int, X: list[float]) -> float:
        b = self.base[l]
        return sum((x + y) ** 2 for x, y in zip(b, X)) if self.overlap else sum(x * x for x in X)

    def busy(self, l: int, X: list[float]) -> list[float]:
        """What a member's share of the layer's maximum is: attention and experts (zebra), experts (DistEP)."""
        return [x + y for x, y in zip(self.base[l], X)] if self.overlap else list(X)


@dataclass
class Placement:
    """owner[l][e]: member index holding expert e of MoE layer l."""
    owner: dict[int, list[int]]

    def of_member(self, l: int, j: int) -> list[int]:
        return [e for e, o in enumerate(self.owner[l]) if o == j]


@dataclass
class Score:
    over: float  # bytes over memory, summed over members
    J: float
    sq: float

    def key(self) -> tuple[float, float, float]:
        """Lexicographic (over, J, sq), over and J to 12 significant digits: two placements whose
        byte sums differ only by the order they were added in (3.6625 vs 3.6625000000000005) are
        equally over, and J decides (found by hypothesis: the rounding picked a worse J)."""
        return (float(f"{self.over:.12g}"), float(f"{self.J:.12g}"), self.sq)


class _State:
    """A placement with its per-layer sums, for cheap step evaluation."""

    def __init__(self, prob: PlacementProblem, pl: Placement):
        self.p, self.owner = prob, {l: list(o) for l, o in pl.owner.items()}
        self.pos = {l: {j: i for i, j in enumerate(prob.stage[l])} for l in prob.layers}
        self.X = {l: [0.0] * len(prob.stage[l]) for l in prob.layers}
        self.used = [0.0] * len(prob.members)
        self.count = [0] * len(prob.members)
        for l in prob.layers:
            for e, j in enumerate(self.owner[l]):
                if j not in prob.cost[l]:
                    raise PlanError(f"MoE layer {l}: expert {e} is on group member {j} (rank {prob.members[j]}), which "
                                    f"may not hold that layer's experts; place it on its stage's ranks")
                self.X[l][self.pos[l][j]] += prob.cost[l][j][e]
                self.used[j] += prob.expert_bytes[l][e]
                self.count[j] += 1
        self.t = {l: prob.layer_time(l, self.X[l]) for l in prob.layers}
        self.s = {l: prob.layer_sq(l, self.X[l]) for l in prob.layers}

    def need(self, j: int, used: float | None = None, count: int | None = None) -> float:
        used = self.used[j] if used is None else used
        count = self.count[j] if count is None else count
        return used + (self.p.work_bytes if count else 0.0)

    def over(self, j: int, used: float | None = None, count: int | None = None) -> float:
        return max(0.0, self.need(j, used, count) - self.p.capacity[j])

    def score(self) -> Score:
        return Score(sum(self.over(j) for j in range(len(self.used))), sum(self.t.values()), sum(self.s.values()))

    def placement(self) -> Placement:
        return Placement({l: list(o) for l, o in self.owner.items()})

    # a step: experts of layer l change members; returns (d_over, dJ, dsq, new X) without applying it
    def trial(self, l: int, changes: list[tuple[int, int, int]]) -> tuple[float, float, float, list[float]]:
        """`changes`: (expert, from member, to member)."""
        p, X, pos = self.p, list(self.X[l]), self.pos[l]
        dused: dict[int, float] = {}
        dcount: dict[int, int] = {}
        for e, a, b in changes:
            X[pos[a]] -= p.cost[l][a][e]
            X[pos[b]] += p.cost[l][b][e]
            dused[a] = dused.get(a, 0.0) - p.expert_bytes[l][e]
            dused[b] = dused.get(b, 0.0) + p.expert_bytes[l][e]
            dcount[a] = dcount.get(a, 0) - 1
            dcount[b] = dcount.get(b, 0) + 1
        d_over = sum(self.over(j, self.used[j] + du, self.count[j] + dcount[j]) - self.over(j)
                     for j, du in dused.items())
        return d_over, p.layer_time(l, X) - self.t[l], p.layer_sq(l, X) - self.s[l], X

    def apply(self, l: int, changes: list[tuple[int, int, int]], X: list[float]) -> None:
        p = self.p
        for e, a, b in changes:
            self.owner[l][e] = b
            self.used[a] -= p.expert_bytes[l][e]
            self.used[b] += p.expert_bytes[l][e]
            self.count[a] -= 1
            self.count[b] += 1
        self.X[l] = X
        self.t[l] = p.layer_time(l, X)
        self.s[l] = p.layer_sq(l, X)


def _better(d: tuple[float, float, float], tol: tuple[float, float, float]) -> bool:
    """Whether a step's (d over, dJ, dsq) lowers (over, J, sq) lexicographically beyond rounding."""
    for x, t in zip(d, tol):
        if x < -t:
            return True
        if x > t:
            return False
    return False


def _steps(st: _State, l: int, sources: list[int]):
    """Every move and swap of an expert held by a member in `sources` within layer l's holders."""
    holders = st.p.holders[l]
    owner = st.owner[l]
    for a in sources:
        mine = [e for e, o in enumerate(owner) if o == a]
        for e in mine:
            for b in holders:
                if b == a:
                    continue
                yield [(e, a, b)]
                for f, o in enumerate(owner):
                    if o == b:
                        yield [(e, a, b), (f, b, a)]


def improve(prob: PlacementProblem, start: Placement, max_passes: int = MAX_PASSES) -> Placement:
    """Local search (module docstring) from `start`; never returns a worse (over, J, sq)."""
    st = _State(prob, start)
    scale_t = max([abs(t) for t in st.t.values()] + [1e-30])
    scale_b = max([b for row in prob.expert_bytes.values() for b in row] + [prob.work_bytes, 1e-30])
    tol = (1e-9 * scale_b, 1e-12 * scale_t, 1e-12 * scale_t * scale_t)  # rounding, not a saving
    for _ in range(max_passes):
        moved = False
        # memory first: steps off the members over their memory, any layer
        while True:
            worst = max(range(len(prob.members)), key=lambda j: st.over(j))
            if st.over(worst) <= 0:
                break
            best = None
            for l in prob.layers:
                if worst not in prob.holders[l]:
                    continue
                for ch in _steps(st, l, [worst]):
                    *d, X = st.trial(l, ch)
                    if _better(tuple(d), tol) and (best is None or tuple(d) < best[0]):
                        best = (tuple(d), l, ch, X)
            if best is None:
                break
            st.apply(best[1], best[2], best[3])
            moved = True
        for l in sorted(prob.layers, key=lambda x: -st.t[x]):  # the costliest layers first
            while True:
                busy = prob.busy(l, st.X[l])
                top = max(busy)
                crit = [prob.stage[l][i] for i, b in enumerate(busy) if b >= top - tol[1]]
                sources = [j for j in crit if j in prob.cost[l]]
                if not sources:
                    break  # an attention piece alone is the layer's maximum
                best = None
                for ch in _steps(st, l, sources):
                    *d, X = st.trial(l, ch)
                    if _better(tuple(d), tol) and (best is None or tuple(d) < best[0]):
                        best = (tuple(d), ch, X)
                if best is None:
                    break
                st.apply(l, best[1], best[2])
                moved = True
        if not moved:
            break
    return st.placement()


def greedy(prob: PlacementProblem) -> Placement:
    """Longest processing time first: each layer's experts, the costliest first, each to the holder
    with room on which the layer would finish it earliest (then: where it runs cheapest)."""
    used = [0.0] * len(prob.members)
    count = [0] * len(prob.members)
    owner: dict[int, list[int]] = {}
    for l in prob.layers:
        pos = {j: i for i, j in enumerate(prob.stage[l])}
        X = [0.0] * len(prob.stage[l])
        own = [-1] * prob.num_experts
        hold = prob.holders[l]
        order = sorted(range(prob.num_experts), key=lambda e: (-min(prob.cost[l][j][e] for j in hold), e))
        for e in order:
            def key(j: int) -> tuple:
                need = used[j] + prob.expert_bytes[l][e] + prob.work_bytes
                busy = prob.busy(l, X)[pos[j]] + prob.cost[l][j][e]
                return (need > prob.capacity[j], busy, prob.cost[l][j][e], j)
            j = min(hold, key=key)
            own[e] = j
            X[pos[j]] += prob.cost[l][j][e]
            used[j] += prob.expert_bytes[l][e]
            count[j] += 1
        owner[l] = own
    return Placement(owner)


def score(prob: PlacementProblem, pl: Placement) -> Score:
    return _State(prob, pl).score()


def solve(prob: PlacementProblem, start: Placement) -> Placement:
    """The better (over, J, sq) of the local search from `start` and from the greedy."""
    return min(candidates(prob, start), key=lambda pl: score(prob, pl).key())


def candidates(prob: PlacementProblem, start: Placement) -> list[Placement]:
    """The local search from `start` and from the greedy, each also with the attention ranks kept out
    of the layers where `start` puts no expert on them (J does not see where in the step a layer
    sits: offload in the last layers delays every backward, which the simulator sees, as
    asym_ea._front_load notes). Distinct placements, in that order."""
    kept = {l: [j for j in prob.holders[l] if j not in prob.attention or j in start.owner[l]] for l in prob.layers}
    variants = [prob] if kept == prob.holders else [prob, dataclasses.replace(prob, holders=kept)]
    out: list[Placement] = []
    for p in variants:
        for s in (start, greedy(p)):
            pl = improve(p, s)
            if all(pl.owner != o.owner for o in out):
                out.append(pl)
    return out


# ---------------------------------------------------------------- from and to a plan
def holds_on_attention(plan: HeteroPlan) -> bool:
    """Whether the load-aware placement may put experts on attention ranks (Asym-EA): under zebra
    with one-rank attention members (the planner builds no Asym-EA on TP members, and a plan
    refuses it with CP), or where the plan already does."""
    return (plan.schedule == ScheduleName.ZEBRA and plan.member_size == 1) or plan.experts_on_attention_ranks_any()


def _layout(plan: HeteroPlan) -> pipeline.PipelineLayout:
    try:
        return pipeline.layout_of_plan(plan, validate=False, virtual=True)
    except PlanError as e:
        raise PlanError(f"the load-aware placement prices a plan's stages as the simulator does, and this plan's are "
                        f"not ({e}); plan without --expert-load") from None


def problem_of_plan(plan: HeteroPlan, cost: CostModel, global_batch: int, load: ExpertLoad,
                    schedule: str | None = None) -> tuple[PlacementProblem, Placement]:
    """The placement problem of `plan`'s ZP groups (all alike) under `load`, priced by `cost` (an
    ExpertSpeedCost for measured speeds), and the plan's own placement as a start."""
    schedule = schedule or plan.schedule
    E = plan.num_experts
    load.check(plan.num_layers, E, "the expert load")
    if plan.pipeline_stages > 1 and schedule != ScheduleName.ZEBRA:
        raise PlanError(f"plan has pipeline_stages={plan.pipeline_stages} under {schedule!r}: its step is Megatron's "
                        f"1F1B model, which takes no expert load; plan zebra, or one stage, with --expert-load")
    lay = _layout(plan)
    g0 = plan.groups[0]
    members = g0.members
    index = {r: j for j, r in enumerate(members)}
    n_att = set(g0.attention_ranks)
    t_mb, share = pipeline.tokens(lay, cost, global_batch)
    members_dp = lay.G * len(lay.attention[0][0]) // lay.tp
    attention_ok = holds_on_attention(plan)
    mult = [load.multipliers(l) for l in range(plan.num_layers)]
    hottest = max(max(m) for m in mult)
    stage: dict[int, list[int]] = {}
    holders: dict[int, list[int]] = {}
    base: dict[int, list[float]] = {}
    costs: dict[int, dict[int, list[float]]] = {}
    ebytes: dict[int, list[float]] = {}
    capacity = [math.inf] * len(members)
    work = 0.0
    price: dict[tuple, float] = {}

    def expert_s(gpu: str, m: float) -> float:
        key = (gpu, m)
        if key not in price:
            price[key] = cost.expert_time(gpu, share * m, False) + cost.expert_time(gpu, share * m, True)
        return price[key]

    for i in range(lay.P):
        if schedule == ScheduleName.ZEBRA:
            alive = lay.R // plan.zebra_waves * wave_warmup(plan.zebra_wave_order, plan.zebra_waves, lay.P, i)
        else:
            alive = pipeline.live_microbatches(lay.P, i, lay.R)
        att, exp = lay.attention[0][i], lay.experts[0][i]
        smem = [index[r] for r in att + exp]
        attn_bytes = cost.pipeline_attention_rank_bytes(t_mb, alive, lay.pieces[i], i == 0, i == lay.P - 1, lay.tp,
                                                        members_dp, lay.cp)
        for j in smem:
            usable = cost.profile(plan.gpu_types[members[j]]).usable_memory_bytes
            capacity[j] = usable - (attn_bytes if members[j] in n_att else 0.0)
        work = max(work, cost.expert_working_bytes(share * hottest))
        for k, l in enumerate(lay.layers[i]):
            s, d = lay.pieces[i][k]
            stage[l] = smem
            base[l] = []
            for j in smem:
                r = members[j]
                if r in n_att:
                    g = plan.gpu_types[r]
                    base[l].append(cost.stage_time(g, s, t_mb, False, lay.tp, dense=d, cp=lay.cp)
                                   + cost.stage_time(g, s, t_mb, True, lay.tp, dense=d, cp=lay.cp))
                else:
                    base[l].append(0.0)
            holders[l] = [j for j in smem if attention_ok or members[j] not in n_att]
            costs[l] = {j: [expert_s(plan.gpu_types[members[j]], mult[l][e]) for e in range(E)] for j in holders[l]}
            ebytes[l] = [cost.per_expert_bytes(share * mult[l][e], alive, lay.G) for e in range(E)]
    owner = {l: [-1] * E for l in range(plan.num_layers)}
    for l in range(plan.num_layers):
        for r, es in g0.placement[l].items():
            for e in es:
                owner[l][e] = index[r]
    prob = PlacementProblem(members, E, stage, holders, base, costs, schedule == ScheduleName.ZEBRA, capacity,
                            ebytes, work, frozenset(index[r] for r in n_att))
    return prob, Placement(owner)


def plan_with(plan: HeteroPlan, prob: PlacementProblem, pl: Placement) -> HeteroPlan:
    """A copy of `plan` with `pl` placed alike in every ZP group (member j of each group holds what
    member j of group 0 holds)."""
    out = HeteroPlan.from_dict(plan.to_dict())
    for g in out.groups:
        g.placement = [{g.members[j]: pl.of_member(l, j) for j in sorted(set(pl.owner[l]))}
                       for l in range(out.num_layers)]
    out.validate()
    return out


def memory_report(prob: PlacementProblem, pl: Placement) -> dict:
    """The member furthest into its memory: rank, GiB needed and usable (inf: unbounded)."""
    st = _State(prob, pl)
    j = max(range(len(prob.members)), key=lambda i: st.need(i) - (prob.capacity[i] if math.isfinite(
        prob.capacity[i]) else 1e30))
    return {"rank": prob.members[j], "GiB": st.need(j) / 2**30, "free_GiB": prob.capacity[j] / 2**30,
            "fits": st.over(j) <= 0 and all(st.over(i) <= 0 for i in range(len(prob.members)))}


@dataclass
class LoadPlacement:
    """place_for_load's answer: the plan to write and what the simulator predicts under the loads."""
    plan: HeteroPlan  # load-aware where predicted faster, else the input plan
    chosen: str  # "load-aware" or "uniform"
    uniform_step_s: float  # the input plan's placement under the loads
    load_aware_step_s: float  # the load-aware placement under the loads
    balanced_step_s: float  # the input plan under balanced routing
    tokens_per_step: float
    uniform_J: float
    load_aware_J: float
    uniform_fits: bool
    load_aware_fits: bool
    experts_on_attention_per_layer: list[int]
    speeds: ExpertSpeeds
    uniform_util: dict[str, float] = field(default_factory=dict)  # GPU type -> busy fraction (SimResult's)
    load_aware_util: dict[str, float] = field(default_factory=dict)

    @property
    def gain(self) -> float:
        return self.uniform_step_s / min(self.uniform_step_s, self.load_aware_step_s)

    def to_dict(self) -> dict:
        return {"placement": self.chosen, "uniform_step_s": self.uniform_step_s,
                "load_aware_step_s": self.load_aware_step_s, "balanced_routing_step_s": self.balanced_step_s,
                "gain": self.gain, "uniform_fits": self.uniform_fits, "load_aware_fits": self.load_aware_fits,
                "experts_on_attention_per_layer": self.experts_on_attention_per_layer,
                "expert_speeds": dict(self.speeds.factors), "expert_speeds_source": self.speeds.source}


def place_for_load(plan: HeteroPlan, cost: CostModel, cluster: Cluster, global_batch: int, load: ExpertLoad,
                   speeds: ExpertSpeeds | None = None, engine: str = "auto") -> LoadPlacement:
    """The load-aware placement of `plan`'s layout for `load` (module docstring), judged against the
    plan's own placement by the simulator under the same loads (and measured `speeds`)."""
    priced = with_speeds(cost, speeds)
    prob, own = problem_of_plan(plan, priced, global_batch, load)
    s_own = score(prob, own)
    t_own = simulate_plan(plan, priced, cluster, global_batch, engine=engine, expert_load=load)
    # the model's candidates, judged by the simulator (the model prices layers alone, the simulator the step);
    # one that fits where the plan's own fits
    tried = []
    for pl in candidates(prob, own):
        sc = score(prob, pl)
        if sc.over > 0 and sc.over >= s_own.over:
            continue
        p = plan_with(plan, prob, pl)
        tried.append((simulate_plan(p, priced, cluster, global_batch, engine=engine, expert_load=load), sc, p))
    if not tried:  # nothing fits: the model's best, reported as not fitting
        pl = solve(prob, own)
        p = plan_with(plan, prob, pl)
        tried.append((simulate_plan(p, priced, cluster, global_batch, engine=engine, expert_load=load),
                      score(prob, pl), p))
    t_best, s_best, aware = min(tried, key=lambda t: t[0].step_time_s)
    balanced = simulate_plan(plan, priced, cluster, global_batch, engine=engine)
    # the load-aware placement must fit where the plan's own does, and be predicted faster
    take = t_best.step_time_s < t_own.step_time_s and (s_best.over <= 0 or s_best.over < s_own.over)
    out = aware if take else plan
    return LoadPlacement(out, "load-aware" if take else "uniform", t_own.step_time_s, t_best.step_time_s,
                         balanced.step_time_s, float(global_batch) * cost.settings.seq_len, s_own.J, s_best.J,
                         s_own.over <= 0, s_best.over <= 0, out.experts_on_attention_per_layer(),
                         speeds or ExpertSpeeds(), dict(t_own.utilization), dict(t_best.utilization))


def settings_cost(cost: CostModel, expert_recompute: str) -> CostModel:
    """`cost` at another expert-recompute level (a plan's)."""
    if cost.settings.expert_recompute == expert_recompute:
        return cost
    return CostModel(cost.model, cost.profiles, dataclasses.replace(cost.settings, expert_recompute=expert_recompute))


__all__ = ["ExpertSpeeds", "ExpertSpeedCost", "LoadPlacement", "Placement", "PlacementProblem", "greedy", "improve",
           "measured_speeds", "place_for_load", "plan_with", "problem_of_plan", "score", "settings_cost", "solve",
           "with_speeds"]
