"""Live re-placement (issue 46 item 4, `--hetero-replan-interval`): a new assignment of each MoE
layer's experts to the ranks of the running plan, from the loads measured since the last decision
and each rank's measured time per token, and whether moving to it pays.

Rules (what a live move may change, and what not):
- the same ranks, roles and ZP groups; an expert of a layer of pipeline stage s stays on a rank of
  stage s; every ZP group keeps holding the same experts at the same member positions (a layer's
  expert on member k of group 0 is on member k of every group: the replica groups do not change);
- memory: each rank holds at most `capacity[rank]` (layer, expert) pairs over all its layers
  (default: what the running plan gives it, so no rank's expert memory grows; an attention rank
  without experts gets none; an expert rank may end up holding nothing in a layer);
- the price of a placement is the experts' compute per step: a holder's seconds in a layer are
  the tokens its experts receive times its measured seconds per token; DistEP waits for a layer's
  slowest holder (sum over layers of the max over holders), zebra streams the layers through each
  holder (max over holders of its sum over layers);
- hysteresis: experts moved by the last move stay where they are; a move happens only when the
  predicted saving over the next interval exceeds `margin` times the move's estimated cost and
  the predicted expert time drops by at least `min_gain` (noise in measured loads and times).

The placement itself is a greedy longest-processing-time assignment: the heaviest (layer, expert)
first, each to the holder where the placement's price grows least (its current holder on a tie),
within capacity. Pure Python, no torch: every rank could compute it; the trainer computes it on
the first rank and broadcasts the result (training/replan.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.vocabulary import ScheduleName, TaskKind

# the compute task kinds that run experts (plan/tasks.py)
EXPERT_KINDS = (TaskKind.E_F, TaskKind.E_B, TaskKind.X_F, TaskKind.X_B)


@dataclass(frozen=True)
class RebalanceConfig:
    """Hysteresis of live moves (module docstring)."""
    margin: float = 2.0  # the predicted saving over the next interval must exceed margin x the move's cost
    min_gain: float = 0.05  # ... and the predicted expert time per step must drop by this fraction

    def __post_init__(self) -> None:
        if not self.margin >= 0:
            raise ValueError(f"replan margin {self.margin} must be >= 0 (0: move whenever a placement is cheaper)")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"replan min_gain {self.min_gain} must be in [0, 1)")


@dataclass
class Proposal:
    """A decision: `plan` is the placement to move to (None: stay)."""
    plan: HeteroPlan | None
    moved: list[tuple[int, int, int, int]] = field(default_factory=list)  # (layer, expert, from rank, to rank), group 0
    seconds_now: float = 0.0  # predicted expert seconds per step, running placement
    seconds_new: float = 0.0  # ... the proposed one
    move_cost_s: float = 0.0  # the estimated cost of the move
    reason: str = ""


def placement_key(plan: HeteroPlan) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Group 0's placement in a comparable form."""
    return [sorted((r, tuple(sorted(es))) for r, es in pl.items() if es) for pl in plan.groups[0].placement]


def check_same_roles(old: HeteroPlan, new: HeteroPlan) -> None:
    """Raise PlanError unless `new` is `old` with only expert placements changed, within the same
    roles, stages and member positions (module docstring)."""
    a, b = old.to_dict(), new.to_dict()
    for d in (a, b):
        for g in d["groups"]:
            g.pop("placement")
        d.pop("meta", None)
    if a != b:
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        raise PlanError(f"a live move may change only the expert placement, not the plan's {diff}; keep the running "
                        f"plan's ranks, roles, groups, schedule and model (remake the plan offline and restart from a "
                        f"checkpoint for anything else)")
    new.validate(world_size=old.world_size)
    g0 = new.groups[0]
    for gi, g in enumerate(new.groups):
        pos = {r: i for i, r in enumerate(g.members)}
        for l, pl in enumerate(g.placement):
            stage = new.stage_of_layer(l)
            for r, es in pl.items():
                if es and new.stage_of(r) != stage:
                    raise PlanError(f"layer {l} of ZP group {gi}: rank {r} (stage {new.stage_of(r)}) holds experts "
                                    f"{es} of stage {stage}; a layer's experts stay on ranks of its stage")
                if gi and sorted(es) != sorted(g0.placement[l].get(g0.members[pos[r]], [])):
                    raise PlanError(f"layer {l}: ZP group {gi}'s member {pos[r]} (rank {r}) holds {sorted(es)}, "
                                    f"group 0's the same position other experts; every group holds the same "
                                    f"experts at the same positions")


def holdings(plan: HeteroPlan) -> dict[int, int]:
    """(layer, expert) pairs each rank holds over all its layers."""
    out = {r: 0 for r in range(plan.world_size)}
    for g in plan.groups:
        for pl in g.placement:
            for r, es in pl.items():
                out[r] += len(es)
    return out


def seconds_per_token(plan: HeteroPlan, tokens: list[list[float]], task_seconds: list[dict[str, float]]
                      ) -> list[float]:
    """Each rank's measured expert seconds per token received (tokens: summed over the world, as
    the stats file's; task_seconds: each rank's, over the same steps). A rank that received
    nothing or measured nothing takes the mean of its GPU type's measured ranks, else of all
    measured ranks, else 1.0 (only relative speeds matter)."""
    G = len(plan.groups)
    got: dict[int, float] = {}
    for g in plan.groups:
        for l, pl in enumerate(g.placement):
            for r, es in pl.items():
                got[r] = got.get(r, 0.0) + sum(tokens[l][e] for e in es) / G
    measured: dict[int, float] = {}
    for r in range(plan.world_size):
        sec = sum((task_seconds[r] if r < len(task_seconds) else {}).get(k, 0.0) for k in EXPERT_KINDS)
        if sec > 0 and got.get(r, 0.0) > 0:
            measured[r] = sec / got[r]
    out = []
    for r in range(plan.world_size):
        if r in measured:
            out.append(measured[r])
            continue
        same = [v for q, v in measured.items() if plan.gpu_types[q] == plan.gpu_types[r]]
        pool = same or list(measured.values())
        out.append(sum(pool) / len(pool) if pool else 1.0)
    return out


def predicted_seconds(plan: HeteroPlan, placement: list[dict[int, list[int]]], per_step: list[list[float]],
                      spt: list[float], schedule: str) -> float:
    """Expert compute seconds per step of group 0's `placement` (module docstring): per_step[l][e]
    is a ZP group's tokens of expert e per step, spt each rank's seconds per token."""
    busy = [{r: sum(per_step[l][e] for e in es) * spt[r] for r, es in pl.items()} for l, pl in enumerate(placement)]
    if schedule == ScheduleName.ZEBRA:
        per_rank: dict[int, float] = {}
        for by in busy:
            for r, s in by.items():
                per_rank[r] = per_rank.get(r, 0.0) + s
        # Each pipeline stage streams its own layers; the slowest stage's holder bounds the step.
        return max(per_rank.values(), default=0.0)
    return sum(max(by.values(), default=0.0) for by in busy)


def _greedy(plan: HeteroPlan, per_step: list[list[float]], spt: list[float], capacity: dict[int, int],
            frozen: set[tuple[int, int]], schedule: str) -> list[dict[int, list[int]]]:
    g0 = plan.groups[0]
    current = [g0.owner(l) for l in range(plan.num_layers)]
    placement: list[dict[int, list[int]]] = [{} for _ in range(plan.num_layers)]
    left = dict(capacity)
    for l, e in sorted(frozen):
        r = current[l][e]
        placement[l].setdefault(r, []).append(e)
        left[r] -= 1
    items = sorted(((l, e) for l in range(plan.num_layers) for e in range(plan.num_experts) if (l, e) not in frozen),
                   key=lambda le: (-per_step[le[0]][le[1]], le))
    holders = {s: [r for r in g0.members if plan.stage_of(r) == s and capacity.get(r, 0) > 0]
               for s in range(plan.pipeline_stages)}
    for l, e in items:
        best = None
        for r in holders[plan.stage_of_layer(l)]:
            if left[r] <= 0:
                continue
            placement[l].setdefault(r, []).append(e)
            price = predicted_seconds(plan, placement, per_step, spt, schedule)
            placement[l][r].pop()
            key = (price, r != current[l][e], r)
            if best is None or key < best[0]:
                best = (key, r)
        if best is None:
            raise PlanError(f"no rank of stage {plan.stage_of_layer(l)} has room for expert {e} of layer {l} "
                            f"(capacities {capacity}); give the ranks at least the running plan's holdings")
        placement[l].setdefault(best[1], []).append(e)
        left[best[1]] -= 1
    return [{r: sorted(es) for r, es in pl.items()} for pl in placement]


def with_placement(plan: HeteroPlan, placement0: list[dict[int, list[int]]]) -> HeteroPlan:
    """`plan` with group 0's placement `placement0`, every other group's by member position."""
    new = copy.deepcopy(plan)
    g0 = plan.groups[0]
    for g in new.groups:
        to_mine = dict(zip(g0.members, g.members))
        g.placement = [{to_mine[r]: list(es) for r, es in pl.items() if es} for pl in placement0]
    return new


def moves(old: HeteroPlan, new: HeteroPlan) -> list[tuple[int, int, int, int]]:
    """(layer, expert, from rank, to rank) of group 0 between two plans."""
    out = []
    for l in range(old.num_layers):
        a, b = old.groups[0].owner(l), new.groups[0].owner(l)
        out += [(l, e, a[e], b[e]) for e in range(old.num_experts) if a[e] != b[e]]
    return out


def propose(plan: HeteroPlan, tokens: list[list[float]], task_seconds: list[dict[str, float]], steps: int,
            next_steps: int, move_cost_s: Callable[[int], float], schedule: str,
            capacity: dict[int, int] | None = None, frozen: set[tuple[int, int]] = frozenset(),
            cfg: RebalanceConfig = RebalanceConfig()) -> Proposal:
    """Whether and where to move (module docstring). `tokens`/`task_seconds`: measured over the
    last `steps` steps under `plan` (the stats file's sums: tokens over the world, seconds per
    rank); `next_steps`: the steps until the next decision; `move_cost_s(n)`: the estimated seconds
    of moving n experts of group 0 (each group moves its own copies at once); `frozen`: (layer,
    expert) pairs that must stay."""
    if steps <= 0 or not any(t for row in tokens for t in row):
        return Proposal(None, reason="no tokens measured")
    G = len(plan.groups)
    per_step = [[t / G / steps for t in row] for row in tokens]
    spt = seconds_per_token(plan, tokens, task_seconds)
    capacity = holdings(plan) if capacity is None else capacity
    current = [dict(pl) for pl in plan.groups[0].placement]
    now = predicted_seconds(plan, current, per_step, spt, schedule)
    placement = _greedy(plan, per_step, spt, capacity, set(frozen), schedule)
    new = predicted_seconds(plan, placement, per_step, spt, schedule)
    candidate = with_placement(plan, placement)
    moved = moves(plan, candidate)
    if not moved or new >= now:
        return Proposal(None, [], now, new, 0.0, "no cheaper placement")
    cost = move_cost_s(len(moved))
    saving = (now - new) * next_steps
    if new > now * (1 - cfg.min_gain):
        return Proposal(None, moved, now, new, cost, f"gain {1 - new / now:.1%} below min_gain {cfg.min_gain:.0%}")
    if saving <= cfg.margin * cost:
        return Proposal(None, moved, now, new, cost,
                        f"saving {saving:.3g} s over {next_steps} steps <= {cfg.margin:g} x move cost {cost:.3g} s")
    return Proposal(candidate, moved, now, new, cost, f"saving {saving:.3g} s over {next_steps} steps")


def propose_simulated(plan: HeteroPlan, tokens: list[list[float]], next_steps: int, cost, cluster,
                      global_batch: int, move_cost_s: Callable[[int], float],
                      cfg: RebalanceConfig = RebalanceConfig()) -> Proposal:
    """Whether and where to move, judged by the simulator where the cluster's cost model is known
    (an emulated run: its emulated cluster and shape). The placement is planner/load_placement's for
    the measured loads (it balances each rank's attention and experts together, within memory),
    taken only where the simulator predicts its step under the same loads faster than the running
    placement's; the hysteresis is `propose`'s, on predicted step seconds (move_cost_s(n): seconds
    on the same clock)."""
    from megatron_hetermoe.planner.expert_load import ExpertLoad
    from megatron_hetermoe.planner.load_placement import place_for_load

    if not any(t for row in tokens for t in row):
        return Proposal(None, reason="no tokens measured")
    got = place_for_load(plan, cost, cluster, global_batch, ExpertLoad.of(tokens))
    now, new = got.uniform_step_s, got.load_aware_step_s
    moved = moves(plan, got.plan)
    if got.chosen != "load-aware" or not moved:
        return Proposal(None, [], now, new, 0.0, "no placement predicted faster")
    check_same_roles(plan, got.plan)
    c = move_cost_s(len(moved))
    saving = (now - new) * next_steps
    if new > now * (1 - cfg.min_gain):
        return Proposal(None, moved, now, new, c,
                        f"simulated gain {1 - new / now:.1%} below min_gain {cfg.min_gain:.0%}")
    if saving <= cfg.margin * c:
        return Proposal(None, moved, now, new, c,
                        f"simulated saving {saving:.3g} s over {next_steps} steps <= {cfg.margin:g} x move cost "
                        f"{c:.3g} s")
    return Proposal(got.plan, moved, now, new, c,
                    f"simulated step {now:.3f} -> {new:.3f} s, saving {saving:.3g} s over {next_steps} steps")


def simulator_prices(gpu_types: list[str]) -> bool:
    """Whether a run on these GPU types has its live moves decided by the simulator (run_pricing):
    every type has a shipped profile, and none is "cpu" (that profile's tables are the tiny
    model's, and CPU ranks' measured seconds are the real thing: the measured-time rule decides)."""
    from megatron_hetermoe.planner.profiles import known_gpu_types

    types = set(gpu_types)
    return "cpu" not in {t.lower() for t in types} and types <= set(known_gpu_types())


def run_pricing(plan: HeteroPlan, model, seq_len: int, global_batch: int, distributed_optimizer: bool = False,
                activation_checkpointing: bool = False, cfg: RebalanceConfig = RebalanceConfig()
                ) -> Callable[[HeteroPlan, list[list[float]], int, Callable[[int], float]], Proposal] | None:
    """The live-move decision of a run on real GPUs: propose_simulated on the plan's own GPU types
    (the planner's shipped profiles, nodes of 8 GPUs of one type as `hetermoe plan --even` prices
    them) for the run's model (`model`: a config.ModelConfig) and batch, with the move cost the
    Replanner gives (the last move's measured cost; before any, one step). None where the
    simulator does not price the plan's GPU types (simulator_prices): the measured-time rule,
    `propose`, decides."""
    from megatron_hetermoe.planner.cluster import Cluster
    from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
    from megatron_hetermoe.planner.profiles import load_profiles

    if not simulator_prices(plan.gpu_types):
        return None
    types = set(plan.gpu_types)
    settings = TrainSettings(seq_len, activation_checkpointing=activation_checkpointing,
                             expert_recompute=plan.expert_recompute, distributed_optimizer=distributed_optimizer)
    cost = CostModel(model.replace(seq_length=seq_len), load_profiles(types), settings)
    cluster = Cluster.from_gpu_types("the run's GPUs", plan.gpu_types)
    return lambda p, tokens, next_steps, move_cost_s: propose_simulated(p, tokens, next_steps, cost, cluster,
                                                                       global_batch, move_cost_s, cfg)
