"""Plan search: pick the ZP group shape (M:N, number of groups), the microbatch count R and the
expert placement for a cluster and model, by simulating every candidate; and predict every
baseline on the same cost model, for the report.

Attention members may be tensor-parallel (plan.attention_tp in ATTENTION_TP, where it divides the
heads and the sequence and each member sits in one node; such a candidate has no Asym-EA) and
context-parallel (plan.attention_cp in ATTENTION_CP, where cp_sizes allows it: 2 cp chunks divide
the sequence, each CP rank's tokens split over the TP size, and the member's tp x cp consecutive
ranks sit in one node, so the K/V exchanges run on the intra-node link as TP's collectives do; no
CP across nodes is searched; no multi-token prediction, which plans refuse with CP, and no Asym-EA:
as with TP, the search's Asym-EA model prices one-rank members; a hand-made plan may hold experts on
CP ranks). A member of tp x cp ranks reads whole sequences, each rank member tokens / (tp cp) of them
(cost_model.py, "Context parallelism"). A candidate whose lower bound (compute_lower_bound) cannot
beat the best simulated step is skipped. CP only pays where members without it cannot get as many
microbatches (few whole sequences per rank: long sequences, small batches), so a CP shape the same
shape without CP matches in R is not a candidate (candidates()), and the CP candidates come last,
skipped before their memory check where a bound with the post-step cannot beat the steps without
CP (_cp_cannot_beat): the 1,024-GPU search's time stays about the same.

Candidates: each GPU type in turn takes the attention role and all other types the expert role
(a homogeneous cluster is split at a few ratios instead); G divides both counts with N <= E;
R divides the sequences each attention rank gets (microbatches are whole sequences). For each
candidate the expert assignment comes from asym_ea (optimal by default); zebra without Asym-EA,
DistEP and the paper's greedy are simulated alongside so the report can compare them.

Memory differs by schedule: zebra keeps all R microbatches alive (Theorem 1 runs every forward
before any backward), so an expert rank holds what it keeps for backward of the routed tokens of
the whole step, whatever R is; DistEP runs each microbatch's forward and backward before the
next, so one is alive. What an expert holder keeps is a level (cost_model.EXPERT_RECOMPUTE):
the search prices the default one (keep-inputs under activation checkpointing) and, for a
candidate whose expert ranks cannot hold every expert without Asym-EA there, each level that
keeps less up to the first where they can ('resend-inputs': nothing; the attention ranks keep
the dispatched tokens and send them again with the gradient); detail["expert_recompute"] and
plan.expert_recompute say which level a prediction and the plan are for. The runtime runs 'off'
and 'keep-inputs' (models/experts.py run_local_experts) and refuses a 'resend-inputs' plan by
name (parallel/state.py).
Pipeline stages (plan.pipeline_stages P in PIPELINE_STAGES, where P divides the decoder layers,
every stage gets an MoE layer and P divides both sides of a ZP group): each group is P stages of
M attention + N expert ranks (as even_plan lays them out), run two ways: DistEP inside the stages
and Megatron's 1F1B across them, no Asym-EA, priced by planner/pipeline.py (its 1F1B step model and
per-stage memory rule, 1F1B keeping min(P - i, R) microbatches alive on stage i); and zebra inside
the stages in W groups of microbatches (every W dividing R; plan.zebra_waves), in GPipe's and in
1F1B's order over the groups where GPipe's does not fit (plan.zebra_wave_order; stage i keeps all R,
or R / W x min(W, P - i) microbatches alive), each W at the lightest expert-recompute level at which
it fits, without and (no TP) with Asym-EA inside each stage (stage_asym_problem, asym_ea.optimal
per stage), its task lists run by the event simulator. Each is skipped when its bound
(pipeline.lower_bound, pipeline.zebra_lower_bound) cannot beat the best step so far. The DistEP and
zebra rows stay one stage; the planner's pick is the
fastest of every zebra variant and DistEP at every P searched (detail["pipeline_stages"]).
When a role split has no candidate that fits (or none that divides the batch), the strategy's
prediction names it in detail["excluded_layouts"] ({layout name: reason}); a strategy that
falls back to a slower layout at a larger batch says why there (e.g. O1, D1, 20K tokens, expert
ranks keeping their inputs: from global batch 84 on, V100s cannot hold 32 experts plus every
microbatch's routed tokens, so zebra without Asym-EA must put attention on the V100s;
planner/HETERO_PP.md, "Smoothness"; with 'resend-inputs' it keeps attention on the A40s).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from dataclasses import asdict, dataclass, field

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import RUNTIME_EXPERT_RECOMPUTE, HeteroPlan, PlanError, ZPGroup
from megatron_hetermoe.plan.tasks import ZEBRA_WAVE_ORDERS, wave_warmup
from megatron_hetermoe.planner import asym_ea, pipeline
from megatron_hetermoe.planner.baselines import (
    BaselineResult,
    best_megatron_ep,
    network_limit,
    newest_gpu,
    physical_limit,
    roofline,
    simulate_ep,
    simulate_ep_ideal,
    simulate_hetero_pp,
)
from megatron_hetermoe.planner.cluster import Cluster, Links, allreduce_time, rank1_collective_time
from megatron_hetermoe.planner.cost_model import (
    EXPERT_RECOMPUTE,
    CostModel,
    TrainSettings,
    heavier_expert_recompute,
)
from megatron_hetermoe.planner.expert_load import ExpertLoad
from megatron_hetermoe.planner.load_placement import ExpertSpeeds, LoadPlacement, place_for_load
from megatron_hetermoe.planner.pipeline import PIPELINE_STAGES, pipeline_sizes
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.simulator import SimResult, simulate_plan
from megatron_hetermoe.vocabulary import ScheduleName

PICK = "HeterMoE (planner's pick)"
ZEBRA = "Zebra + Asym-EA (optimal)"
ZEBRA_GREEDY = "Zebra + Asym-EA (paper's greedy)"
ZEBRA_NO_EA = "Zebra (no Asym-EA)"
DISTEP = "DistEP"
DISTEP_PP = "DistEP with pipeline stages"  # P > 1: no row of its own; a candidate for the pick
ZEBRA_PP = "Zebra with pipeline stages"  # P > 1, no Asym-EA: likewise
# With measured expert loads (search(expert_load=...)): the pick's own placement and the load-aware
# one, both priced under the loads (planner/load_placement.py)
LOAD_UNIFORM = "HeterMoE pick, uniform placement, measured loads"
LOAD_AWARE = "HeterMoE, load-aware placement, measured loads"
LOAD_CANDIDATES = 6  # the fastest simulated candidates (balanced routing) re-placed and priced under the loads
# The rows that are bounds, not strategies: the compute-only physical limit, the network floor of
# disaggregated layouts and their roofline (baselines.py).
LIMIT_ROWS = ("Physical limit", "Network + compute floor (layouts)", "Roofline (compute + network)")
SCHEDULE_OF = {ZEBRA: ScheduleName.ZEBRA, ZEBRA_GREEDY: ScheduleName.ZEBRA, ZEBRA_NO_EA: ScheduleName.ZEBRA,
               ZEBRA_PP: ScheduleName.ZEBRA, DISTEP: ScheduleName.DISTEP, DISTEP_PP: ScheduleName.DISTEP}


@dataclass
class Prediction:
    name: str
    step_time_s: float
    tokens_per_s: float
    utilization: dict[str, float] = field(default_factory=dict)
    # tokens/s over the limit's: HeterMoE's strategies the roofline of compute and network
    # (baselines.ROOFLINE), the baselines (not disaggregated) the compute-only physical limit
    ratio_to_limit: float = 0.0
    fits: bool = True
    detail: dict = field(default_factory=dict)


@dataclass
class SearchResult:
    plan: HeteroPlan | None
    predictions: list[Prediction]
    candidates: int
    elapsed_s: float
    expert_load: dict | None = None  # with measured loads: the uniform vs load-aware report (plan.meta's too)

    def by_name(self) -> dict[str, Prediction]:
        return {p.name: p for p in self.predictions}

    def to_dict(self) -> dict:
        out = {"strategies": [asdict(p) for p in self.predictions], "candidates": self.candidates,
               "elapsed_s": self.elapsed_s, "plan": self.plan.to_dict() if self.plan else None}
        if self.expert_load is not None:
            out["expert_load"] = self.expert_load
        return out


@dataclass
class Candidate:
    attention_ranks: list[int]
    expert_ranks: list[int]
    G: int
    R: int
    tp: int = 1  # attention_tp: each attention member is tp consecutive ranks (one TP group)
    P: int = 1  # pipeline stages: each group is P stages of len(attention_ranks) / (G P) attention ranks
    cp: int = 1  # attention_cp: each attention member is tp x cp consecutive ranks, TP position fastest

    @property
    def member(self) -> int:
        """Ranks of one attention member: tp x cp."""
        return self.tp * self.cp

    @property
    def stage_shape(self) -> tuple[int, int]:
        """(M, N): attention and expert ranks of one pipeline stage of one ZP group."""
        return len(self.attention_ranks) // (self.G * self.P), len(self.expert_ranks) // (self.G * self.P)


ATTENTION_TP = (1, 2, 4, 8)  # the attention members' TP sizes the search tries


def _members_in_nodes(attn: list[int], size: int, nodes: list[int]) -> bool:
    """Whether attention ranks `attn` form members of `size` consecutive ranks, each inside one node
    (`nodes`: the cluster's node of each rank): TP's and CP's collectives run on the intra-node link."""
    return not len(attn) % size and all(len({nodes[r] for r in attn[i:i + size]}) == 1
                                         for i in range(0, len(attn), size))


def tp_sizes(cluster: Cluster, model: ModelConfig, seq_len: int, attn: list[int]) -> dict[int, str]:
    """attention_tp sizes for attention ranks `attn` (in the order the search groups them), each
    with '' if usable, else why not: tp must divide the heads (each rank holds heads / tp) and
    the sequence (sequence parallelism gives each rank seq_len / tp tokens of every sequence), and
    every member (tp consecutive ranks of `attn`) must sit inside one node (TP runs on NVLink)."""
    nodes = cluster.node_of()
    out = {}
    for tp in ATTENTION_TP:
        if tp == 1:
            out[tp] = ""
        elif model.num_attention_heads % tp or model.query_groups % tp:
            out[tp] = (f"attention_tp {tp} does not divide the {model.num_attention_heads} heads and the "
                       f"{model.query_groups} query groups")
        elif seq_len % tp:
            out[tp] = f"attention_tp {tp} does not divide the sequence length {seq_len}"
        elif not _members_in_nodes(attn, tp, nodes):
            out[tp] = f"attention_tp {tp}: the attention ranks do not form members of {tp} ranks inside one node"
        else:
            out[tp] = ""
    return out


ATTENTION_CP = (1, 2, 4, 8)  # the attention members' context-parallel sizes the search tries


def cp_sizes(cluster: Cluster, model: ModelConfig, seq_len: int, attn: list[int], tp: int = 1) -> dict[int, str]:
    """attention_cp sizes for attention ranks `attn` (in the order the search groups them) with TP
    size `tp`, each with '' if usable, else why not: the sequence must split into 2 x cp chunks
    (Megatron's load-balanced split: each CP rank holds two), a CP rank's seq_len / cp tokens must
    split over the tp ranks (sequence parallelism), and every member (tp x cp consecutive ranks of
    `attn`) must sit inside one node (its K/V exchanges are priced on the intra-node link, as TP's
    collectives are; CP across nodes is not searched). Heads need not divide by cp (every CP rank
    computes every head of its own queries). No multi-token prediction with cp > 1: plans refuse it
    (HeteroPlan.validate)."""
    nodes = cluster.node_of()
    out = {}
    for cp in ATTENTION_CP:
        n = tp * cp
        if cp == 1:
            out[cp] = ""
        elif seq_len % (2 * cp):
            out[cp] = (f"attention_cp {cp}: the sequence length {seq_len} does not split into 2 x {cp} = {2 * cp} "
                       f"chunks (Megatron's load-balanced split); use a sequence length that is a multiple of "
                       f"{2 * cp}, or a smaller attention_cp")
        elif (seq_len // cp) % tp:
            out[cp] = (f"attention_cp {cp}: a CP rank's {seq_len // cp} tokens do not split over attention_tp {tp} "
                       f"(sequence parallelism)")
        elif model.mtp_num_layers:
            out[cp] = (f"attention_cp {cp} with {model.mtp_num_layers} multi-token prediction layer(s): not built "
                       f"with context parallelism (plans refuse it); use attention_cp 1")
        elif not _members_in_nodes(attn, n, nodes):
            out[cp] = (f"attention_cp {cp} with attention_tp {tp}: the attention ranks do not form members of "
                       f"{tp} x {cp} = {n} ranks inside one node (TP and CP run on the intra-node link)")
        else:
            out[cp] = ""
    return out


ONE_WAVE = (1, "gpipe")  # (zebra_waves, zebra_wave_order) of a plan without waves


def zebra_configs(R: int) -> list[tuple[int, str]]:
    """(zebra_waves, zebra_wave_order) that may be tried for zebra inside pipeline stages at R
    microbatches: every W dividing R in GPipe's order, and for W > 1 in 1F1B's (with one group
    the orders agree)."""
    return [(W, order) for W in _divisors(R) for order in ZEBRA_WAVE_ORDERS if W > 1 or order == "gpipe"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_name(gpu_types: list[str], attn: list[int], expert: list[int], pipeline_stages: int = 1) -> str:
    """Name of a role split, as detail["layout"] and the keys of detail["excluded_layouts"] give it
    (with pipeline stages P > 1: ', P pipeline stages' after it)."""
    def side(ranks: list[int]) -> str:
        counts: dict[str, int] = {}
        for r in ranks:
            counts[gpu_types[r]] = counts.get(gpu_types[r], 0) + 1
        return " + ".join(f"{n} {g}" for g, n in counts.items())
    stages = f", {pipeline_stages} pipeline stages" if pipeline_stages > 1 else ""
    return f"attention on {side(attn)}, experts on {side(expert)}{stages}"


def _role_splits(cluster: Cluster) -> list[tuple[list[int], list[int]]]:
    types = cluster.gpu_types()
    kinds = list(cluster.counts())
    if len(kinds) >= 2:
        out = []
        for att in kinds:
            a = [r for r, t in enumerate(types) if t == att]
            x = [r for r, t in enumerate(types) if t != att]
            out.append((a, x))
        return out
    W = len(types)
    return [(list(range(A)), list(range(A, W))) for A in sorted({max(1, W // 4), max(1, W // 3), W // 2}) if 0 < A < W]


def asym_problem(cost: CostModel, gpu_types: list[str], attn: list[int], expert: list[int], G: int, R: int,
                 global_batch: int, forward_only: bool, microbatches_alive: int | None = None,
                 tp: int = 1, cp: int = 1) -> asym_ea.AsymProblem:
    """Asym-EA inputs for one ZP group shape: per-microbatch times (forward, or forward+backward)
    and memory limits, from the cost model. Mixed types on one side: the slowest / smallest.
    `microbatches_alive`: microbatches whose activations coexist (zebra: R, the default; DistEP: 1).
    `tp`, `cp`: the attention members' TP and CP sizes (attention times and memory per rank, its
    share of the member's tokens)."""
    alive = R if microbatches_alive is None else microbatches_alive
    if not 1 <= alive <= R:
        raise ValueError(f"microbatches_alive={alive} must be in 1..R={R} (zebra: R, DistEP: 1)")
    m = cost.model
    # stage l < L: MoE layer l (+ its dense layers)
    L, E, k = m.planned_num_moe_layers, m.num_experts, m.moe_router_topk
    M, N = len(attn), len(expert)
    t_mb = global_batch * cost.settings.seq_len / (G * M * R)
    tpe = M * t_mb * k / E
    a_gpus = sorted({gpu_types[r] for r in attn})
    x_gpus = sorted({gpu_types[r] for r in expert})

    def stage(g: str, l: int) -> float:
        return (cost.stage_time(g, l, t_mb, False, tp, cp=cp)
                + (0.0 if forward_only else cost.stage_time(g, l, t_mb, True, tp, cp=cp)))

    t_attn = tuple(max(stage(g, l) for g in a_gpus) for l in range(L))
    extra = max(stage(g, L) for g in a_gpus)
    dp = G * M // tp  # the ranks at one TP position: the dense weights' data x context parallel size
    return _asym_with_experts(cost, a_gpus, x_gpus, M, N, G, tpe, alive, t_attn, extra, forward_only,
                              cost.attention_rank_bytes(t_mb, alive, tp=tp, dp=dp, cp=cp))


def _asym_with_experts(cost: CostModel, a_gpus: list[str], x_gpus: list[str], M: int, N: int, G: int, tpe: float,
                       alive: int, t_attn: tuple[float, ...], extra: float, forward_only: bool,
                       attention_bytes: float) -> asym_ea.AsymProblem:
    """An AsymProblem from its attention times and an attention rank's bytes without experts: the
    expert times on each role's GPUs (the slowest type) and how many experts each role's ranks
    hold next to `alive` microbatches' routed tokens (the smallest type)."""
    def both(g: str) -> float:
        return cost.expert_time(g, tpe, False) + (0.0 if forward_only else cost.expert_time(g, tpe, True))

    per = cost.per_expert_bytes(tpe, alive, G)  # an expert's replicas: one per ZP group
    work = cost.expert_working_bytes(tpe)
    free_a = min(cost.profile(g).usable_memory_bytes for g in a_gpus) - attention_bytes - work
    free_x = min(cost.profile(g).usable_memory_bytes for g in x_gpus) - work
    n_max = math.floor(free_a / per) if free_a >= 0 else -1
    cap_x = max(0, math.floor(free_x / per))
    return asym_ea.AsymProblem(len(t_attn), cost.model.num_experts, M, N, t_attn, max(map(both, x_gpus)),
                               max(map(both, a_gpus)), n_max, cap_x, extra)


def build_plan(model: ModelConfig, gpu_types: list[str], attn: list[int], expert: list[int], G: int, R: int,
               k: list[int], schedule: str = ScheduleName.ZEBRA, validate: bool = True, skeleton: bool = False,
               attention_tp: int = 1, pipeline_stages: int = 1, zebra_waves: int = 1,
               zebra_wave_order: str = "gpipe", attention_cp: int = 1) -> HeteroPlan:
    """G groups of M attention + N expert ranks (consecutive in `attn` / `expert`), experts placed
    by asym_ea.placement(k) (one entry per MoE layer) alike in every group; the model's dense
    layers are the plan's dense_layers. `skeleton`: only group 0 gets a placement (the
    simulator reads no other); such a plan is for simulation inside the search only.
    `pipeline_stages` P > 1: each group's ranks are P stages of M / P attention and N / P expert
    ranks, stage by stage (even_plan's layout), each layer's experts split evenly over its
    stage's expert ranks; no Asym-EA (k all 0); zebra in `zebra_waves` groups of microbatches in
    `zebra_wave_order`. `attention_tp`, `attention_cp`: attention members of tp x cp consecutive
    ranks (no Asym-EA with cp > 1: the search's Asym-EA model prices one-rank members)."""
    if any(k) and attention_cp > 1:
        raise PlanError(f"experts on attention ranks (Asym-EA, {list(k)}) with attention_cp={attention_cp}: the "
                        f"search prices Asym-EA on one-rank members only; use k all 0")
    if pipeline_stages > 1:
        return _build_pipelined_plan(model, gpu_types, attn, expert, G, R, k, schedule, validate, skeleton,
                                     attention_tp, pipeline_stages, zebra_waves, zebra_wave_order, attention_cp)
    M, N = len(attn) // G, len(expert) // G
    local = asym_ea.placement(k, model.num_experts, list(range(M)), list(range(M, M + N)))
    groups = []
    for g in range(G):
        a, x = attn[g * M:(g + 1) * M], expert[g * N:(g + 1) * N]
        members = a + x
        pl = [] if skeleton and g else [{members[i]: list(es) for i, es in p.items()} for p in local]
        groups.append(ZPGroup(a, x, pl))
    plan = HeteroPlan(model.planned_num_moe_layers, model.num_experts, list(gpu_types), groups, R, schedule,
                      dense_layers=model.planned_dense_layers, mtp_layers=model.mtp_num_layers or 0,
                      attention_tp=attention_tp, attention_cp=attention_cp)
    if validate and not skeleton:
        plan.validate()
    return plan


def _build_pipelined_plan(model: ModelConfig, gpu_types: list[str], attn: list[int], expert: list[int], G: int,
                          R: int, k: list[int], schedule: str, validate: bool, skeleton: bool, attention_tp: int,
                          P: int, W: int = 1, order: str = "gpipe", cp: int = 1) -> HeteroPlan:
    if any(k) and attention_tp > 1:
        raise PlanError(f"experts on attention ranks (Asym-EA, {list(k)}) with attention_tp={attention_tp}: "
                        f"the planner builds TP attention members without Asym-EA; use k all 0")
    if schedule not in (ScheduleName.DISTEP, ScheduleName.ZEBRA):
        raise PlanError(f"schedule {schedule!r} is unknown; use 'zebra' or 'distep'")
    if len(attn) % (G * P) or len(expert) % (G * P):
        raise PlanError(f"{len(attn)} attention and {len(expert)} expert ranks do not split into {G} ZP groups of {P} "
                        f"pipeline stages")
    M, N = len(attn) // G, len(expert) // G
    groups = [ZPGroup(attn[g * M:(g + 1) * M], expert[g * N:(g + 1) * N], []) for g in range(G)]
    plan = HeteroPlan(model.planned_num_moe_layers, model.num_experts, list(gpu_types), groups, R, schedule,
                      dense_layers=model.planned_dense_layers, mtp_layers=model.mtp_num_layers or 0,
                      attention_tp=attention_tp, pipeline_stages=P, zebra_waves=W,
                      zebra_wave_order=order, attention_cp=cp)
    plan.place_evenly(range(1 if skeleton else G))
    if any(k):  # Asym-EA inside each stage: k[l] experts of layer l on the stage's attention ranks
        for g in range(1 if skeleton else G):
            for i in range(P):
                a, x = plan.stage_ranks(g, i)
                members = a + x
                layers = plan.stage_moe_layers(i)
                local = asym_ea.placement([k[l] for l in layers], model.num_experts, list(range(len(a))),
                                          list(range(len(a), len(members))))
                for l, pl in zip(layers, local):
                    plan.groups[g].placement[l] = {members[r]: list(es) for r, es in pl.items()}
    if validate and not skeleton:
        plan.validate()
    return plan


def stage_asym_problem(cost: CostModel, lay: pipeline.PipelineLayout, stage: int,
                       global_batch: int) -> asym_ea.AsymProblem:
    """Asym-EA inputs for pipeline stage `stage` of a layout under zebra (all R microbatches alive):
    as asym_problem over the stage's MoE layers, their attention pieces (the last stage's head as
    the extra piece) and an attention rank's memory for the stage's pieces only."""
    i, c = stage, cost
    att, exp = lay.attention[0][i], lay.experts[0][i]
    M, N = len(att), len(exp)
    t, tpe = pipeline.tokens(lay, c, global_batch)
    a_gpus = sorted({lay.gpu_types[r] for r in att})
    x_gpus = sorted({lay.gpu_types[r] for r in exp})
    L_i = len(lay.layers[i])

    def piece(g: str, s: int, d: int) -> float:
        return (c.stage_time(g, s, t, False, lay.tp, dense=d, cp=lay.cp)
                + c.stage_time(g, s, t, True, lay.tp, dense=d, cp=lay.cp))

    t_attn = tuple(max(piece(g, s, d) for g in a_gpus) for s, d in lay.pieces[i][:L_i])
    extra = max(sum(piece(g, s, d) for s, d in lay.pieces[i][L_i:]) for g in a_gpus)
    base = c.pipeline_attention_rank_bytes(t, lay.R, lay.pieces[i], i == 0, i == lay.P - 1, lay.tp,
                                           lay.G * M // lay.tp, lay.cp)
    return _asym_with_experts(c, a_gpus, x_gpus, M, N, lay.G, tpe, lay.R, t_attn, extra, False, base)


def candidates(cluster: Cluster, model: ModelConfig, global_batch: int, max_microbatches: int = 32,
               seq_len: int | None = None, attention_tp: tuple[int, ...] | None = None,
               pipeline_stages: tuple[int, ...] | None = None, micro_batch_size: int | None = None,
               attention_cp: tuple[int, ...] | None = None) -> list[Candidate]:
    """Every (role split, attention_tp, attention_cp, G, R) and pipeline size P: attention_tp from
    `attention_tp` (default ATTENTION_TP) where tp_sizes allows it, attention_cp from
    `attention_cp` (default ATTENTION_CP) where cp_sizes allows it with that TP size, P from
    `pipeline_stages` (default PIPELINE_STAGES) where pipeline_sizes allows it, G dividing both
    sides into groups of P stages with a stage's M a multiple of tp x cp and its N <= E, R dividing
    the sequences each attention member gets (whole sequences; with `micro_batch_size` m only R =
    those sequences / m, the run's --micro-batch-size, whatever max_microbatches). Candidates with
    cp = 1 come first, P = 1 before P > 1 (the bound of a pipelined candidate is checked against
    the best DistEP step so far), then those with cp > 1 in the same order (each checked against
    every step without CP: _cp_cannot_beat).
    A CP candidate is left out where the same shape without CP (same role split, G, P, tp) is a
    candidate at the same R: each rank then gets the same tokens per microbatch (member tokens
    / (tp cp) with cp times fewer members), so the same compute, dispatch, gradient all-reduce
    (the same ranks at each TP position) and expert work, and CP only adds its K/V exchanges
    and their bytes (every task lasts at least as long, which no event of the simulator can gain
    from, and every rank needs at least as much memory). CP pays where members without it cannot
    get that R: too few whole sequences per rank (long sequences, small batches)."""
    out = []
    seq_len = seq_len or model.seq_length
    sizes = [P for P, why in pipeline_sizes(model, tuple(pipeline_stages or PIPELINE_STAGES)).items() if not why]
    for P in sorted(sizes):
        for attn, expert in _role_splits(cluster):
            for tp, why in tp_sizes(cluster, model, seq_len, attn).items():
                if why or tp not in (attention_tp or ATTENTION_TP):
                    continue
                plain: set[tuple[int, int]] = set()  # (G, R) of this shape without CP
                for cp, why_cp in cp_sizes(cluster, model, seq_len, attn, tp).items():
                    if why_cp or cp not in (attention_cp or ATTENTION_CP):
                        continue
                    for cand in _shapes(model, global_batch, max_microbatches, micro_batch_size, attn, expert,
                                        tp, cp, P):
                        if cp == 1:
                            plain.add((cand.G, cand.R))
                        elif (cand.G, cand.R) in plain:
                            continue  # dominated: the same shape without CP at this R
                        out.append(cand)
    return sorted(out, key=lambda c: c.cp > 1)  # stable: the order above, CP candidates last


def _shapes(model: ModelConfig, global_batch: int, max_microbatches: int, micro_batch_size: int | None,
            attn: list[int], expert: list[int], tp: int, cp: int, P: int) -> list[Candidate]:
    """candidates() of one role split, member shape and pipeline size: every G and R."""
    out = []
    for G in _divisors(math.gcd(len(attn), len(expert))):
        if len(attn) % (G * P) or len(expert) % (G * P):
            continue  # each group's two sides split into P stages
        M, N = len(attn) // (G * P), len(expert) // (G * P)
        if N > model.num_experts or M % (tp * cp):
            continue
        members = G * M // (tp * cp)  # attention members of one stage over all groups: the data-parallel size
        if global_batch % members:
            continue  # every attention member gets whole sequences
        spr = global_batch // members
        if micro_batch_size is not None:  # the run's micro batch fixes R
            if spr % micro_batch_size == 0:
                out.append(Candidate(attn, expert, G, spr // micro_batch_size, tp, P, cp))
            continue
        # most microbatches first: zebra's best, so the bound prunes more
        for R in reversed(_divisors(spr)):
            if R <= max_microbatches:
                out.append(Candidate(attn, expert, G, R, tp, P, cp))
    return out


_HOLDING: dict[tuple[int, int, int], dict] = {}


def _even_holding(E: int, M: int, N: int) -> dict:
    """Experts per group member (0..M+N-1) of one MoE layer without Asym-EA, as build_plan places them."""
    key = (E, M, N)
    if key not in _HOLDING:
        _HOLDING[key] = asym_ea.placement([0], E, list(range(M)), list(range(M, M + N)))[0]
    return _HOLDING[key]


def compute_lower_bound(cost: CostModel, gpu_types: list[str], cand: Candidate, global_batch: int,
                        k: list[int], cluster: Cluster | None = None,
                        schedule: str = ScheduleName.ZEBRA) -> float:
    """A lower bound on the simulated step of a candidate, from the simulator's own durations
    (simulator.build_problem): a rank runs its compute tasks one at a time, so the step is at
    least the compute of its busiest attention rank (R microbatches of every attention stage,
    forward and backward; with Asym-EA also the ceil(k_l / M) experts it holds of each layer l) and
    of an expert rank holding ceil(E / N) (with Asym-EA ceil((E - k_l) / N)) experts of every layer
    (at the fastest GPU type of the role); with `cluster`, k all 0 and N | E (or
    no node holding both roles: then with an even fractional share of experts per rank), also
    the collectives of either stream (each runs one at a time), and one microbatch's dependency
    chain (every attention stage, and per layer dispatch, experts, combine, forward and
    backward), R of them back to back under DistEP (a microbatch's forward and backward run
    before the next one's). The search skips a candidate whose bound is no less than the best
    step simulated so far: it cannot win."""
    m = cost.model
    L, E, k_top = m.planned_num_moe_layers, m.num_experts, m.moe_router_topk
    M, N = len(cand.attention_ranks) // cand.G, len(cand.expert_ranks) // cand.G
    t_mb = global_batch * cost.settings.seq_len / (cand.G * M * cand.R)
    a_gpus = {gpu_types[r] for r in cand.attention_ranks[:M]}
    attn = max(sum(cost.stage_time(g, s, t_mb, b, cand.tp, cp=cand.cp) for s in range(L + 1) for b in (False, True))
               for g in a_gpus)  # one microbatch on one attention rank
    lb = cand.R * attn
    if any(k) and len(k) == L:  # Asym-EA: an attention rank also runs its experts, an expert rank its share
        tpe = M * t_mb * k_top / E
        x_gpus = {gpu_types[r] for r in cand.expert_ranks[:N]}

        def both(g: str) -> float:
            return cost.expert_time(g, tpe, False) + cost.expert_time(g, tpe, True)

        lb = max(cand.R * (attn + sum(asym_ea.attention_max(x, M) for x in k) * min(map(both, a_gpus))),
                 cand.R * sum(asym_ea.expert_max(x, E, N) for x in k) * min(map(both, x_gpus)))
    if not any(k):
        tpe = M * t_mb * k_top / E
        x_gpus = {gpu_types[r] for r in cand.expert_ranks[:N]}
        per = min(cost.expert_time(g, tpe, False) + cost.expert_time(g, tpe, True) for g in x_gpus)
        experts = L * math.ceil(E / N) * per  # one microbatch on the busiest expert rank
        lb = max(lb, cand.R * experts)
        nodes = cluster.node_of() if cluster is not None else []
        apart = cluster is not None and not ({nodes[r] for r in cand.attention_ranks[:M]}
                                             & {nodes[r] for r in cand.expert_ranks[:N]})
        if cluster is not None and (E % N == 0 or apart):
            members = cand.attention_ranks[:M] + cand.expert_ranks[:N]
            links = Links.for_ranks(cluster, members, cost.profiles)
            s_tok = [t_mb] * M + [0.0] * N
            if E % N == 0:  # every layer alike: the layer's own collective
                held = _even_holding(E, M, N)
                w = [0.0] * M + [len(held.get(i, [])) / E for i in range(M, M + N)]
            else:  # remainders rotate over layers; with no attention and expert rank sharing a node, an
                # even fractional share (1/N each) gives every rank's bytes at most the layer's most loaded
                w = [0.0] * M + [1.0 / N] * N
            tb = k_top * cost.token_bytes()
            fwd, bwd = rank1_collective_time(links, s_tok, w, tb), rank1_collective_time(links, w, s_tok, tb)
            c_b = rank1_collective_time(links, s_tok, w, 2 * tb) if cost.settings.expert_recompute == "resend-inputs" \
                else fwd
            lb = max(lb, cand.R * L * (fwd + c_b), cand.R * L * (2 * bwd))
            chain = attn + experts + L * (fwd + c_b + 2 * bwd)
            lb = max(lb, cand.R * chain if schedule == ScheduleName.DISTEP else chain)
    return lb * (1 - 1e-9)


def _memory_reason(prob: asym_ea.AsymProblem, k: list[int], a_gpu: str, x_gpu: str, alive: int,
                   expert_recompute: str = "keep-inputs") -> tuple[float, str]:
    """Why assignment k does not fit, in experts per rank (what asym_ea counts), with the shortfall
    (experts over capacity; the search names a layout by its candidate closest to fitting).
    `expert_recompute`: the level the problem was priced at (what expert holders keep)."""
    rec = f"expert recompute {expert_recompute!r}"
    if prob.n_max < 0:
        return (1e9, f"an attention rank ({a_gpu}) cannot hold the non-expert model and {alive} microbatch(es) "
                     f"of activations ({rec})")
    a = sum(asym_ea.attention_max(x, prob.M) for x in k)
    q = sum(asym_ea.expert_max(x, prob.num_experts, prob.N) for x in k)
    if q > prob.cap_x:
        if expert_recompute == "resend-inputs":  # nothing kept per microbatch: only the working set is left
            kept = "with its working set"
        else:
            what = "routed tokens and expert intermediates" if expert_recompute == "off" else "routed tokens"
            kept = f"next to the {what} of {alive} live microbatch(es) kept for backward"
        return (q - prob.cap_x, f"an expert rank ({x_gpu}) must hold {q} experts but fits {prob.cap_x} {kept} "
                                f"({rec}); move experts to the attention side (Asym-EA)")
    return (a - prob.n_max, f"an attention rank ({a_gpu}) must hold {a} experts but fits {prob.n_max} ({rec})")


def _pred(name: str, res, limit_tps: float, detail: dict | None = None) -> Prediction:
    if isinstance(res, BaselineResult) and not res.fits:
        return Prediction(name, float("inf"), 0.0, {}, 0.0, False, {"reason": res.reason, **res.detail})
    return Prediction(name, res.step_time_s, res.tokens_per_s, dict(res.utilization),
                      res.tokens_per_s / limit_tps if limit_tps else 0.0, True,
                      dict(detail if detail is not None else getattr(res, "detail", {})))


def _cyclic_gc_paused(fn):
    """Run `fn` with Python's cyclic garbage collector paused. The search allocates millions of
    short-lived objects (freed by reference counting), each allocation burst triggering a
    collection that walks the whole heap: in a process that imported torch and megatron-core
    that made a 1024-GPU search 2.3x slower (3.5 s vs 1.5 s of CPU). Cycles it leaves are
    collected once the collector runs again."""
    @functools.wraps(fn)
    def paused(*a, **k):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*a, **k)
        finally:
            if was:
                gc.enable()

    return paused


@dataclass(frozen=True, slots=True)
class Option:
    """One simulated way to run the step: a candidate shape, the experts of each MoE layer on its
    attention ranks (Asym-EA's k; all 0 without it), the schedule, what expert holders keep for
    backward (cost_model.EXPERT_RECOMPUTE) and, for zebra in pipeline stages, its (zebra_waves,
    zebra_wave_order); with its predicted step."""
    step_s: float
    result: SimResult | pipeline.PipelineResult | None  # None in the options kept for expert loads (their step only)
    candidate: Candidate
    experts_on_attention: list[int]
    schedule: ScheduleName
    expert_recompute: str
    waves: tuple[int, str] = ONE_WAVE


# The strategies search() prices; PICK is the fastest of those whose schedule the pick may take
VARIANTS = (ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA, DISTEP, DISTEP_PP, ZEBRA_PP)


@dataclass(slots=True)
class _Search:
    """What search()'s steps share: its inputs, the cost model at each expert-recompute level it
    prices, and its bookkeeping: each strategy's fastest option, the layouts each fits, why each did
    not fit the others (layout -> (shortfall, reason)) and, with expert loads, every option the
    pick could take."""
    model: ModelConfig
    cluster: Cluster
    seq_len: int
    global_batch: int
    asym: str
    engine: str
    distributed_optimizer: bool
    allowed: set[str]  # the schedules the pick may take
    p_try: tuple[int, ...]
    tp_try: tuple[int, ...]
    cp_try: tuple[int, ...]
    types: list[str]
    cost: CostModel  # at the settings' default expert-recompute level
    levels: tuple[str, ...]  # the expert-recompute levels priced, lightest first
    costs: dict[str, CostModel]  # level -> its cost model
    keep_tried: bool  # expert loads given: fill `tried`
    best: dict[str, Option] = field(default_factory=dict)
    fitted: dict[str, set[str]] = field(default_factory=lambda: {n: set() for n in VARIANTS})
    # (attention, expert ranks, G, P): the network floor's
    fit_layouts: dict[tuple, tuple] = field(default_factory=dict)
    why: dict[str, dict[str, tuple[float, str]]] = field(default_factory=lambda: {n: {} for n in VARIANTS})
    tried: list[Option] = field(default_factory=list)
    names: dict[tuple, str] = field(default_factory=dict)  # layout names, made once per role split
    posts: dict[tuple, float] = field(default_factory=dict)  # post-step bounds of CP candidates (_cp_cannot_beat)

    def layout_of(self, cand: Candidate) -> str:
        key = (id(cand.attention_ranks), id(cand.expert_ranks), cand.P)  # the rank lists _role_splits made
        if key not in self.names:
            self.names[key] = layout_name(self.types, cand.attention_ranks, cand.expert_ranks, cand.P)
        return self.names[key]

    def fits(self, name: str, cand: Candidate) -> None:
        """`cand` fits in memory for strategy `name`: its layout is not excluded there."""
        self.fitted[name].add(self.layout_of(cand))
        self.fit_layouts.setdefault((id(cand.attention_ranks), id(cand.expert_ranks), cand.G, cand.P),
                                    (cand.attention_ranks, cand.expert_ranks, cand.G, cand.P))

    def best_step(self) -> float | None:
        """The fastest step of any strategy so far (None before the first)."""
        steps = [self.best[n].step_s for n in VARIANTS if n in self.best]
        return min(steps) if steps else None

    def keep(self, name: str, option: Option) -> None:
        if name not in self.best or option.step_s < self.best[name].step_s:
            self.best[name] = option

    def refuse(self, names: tuple[str, ...], cand: Candidate, reason: tuple[float, str]) -> None:
        # a layout's reason is its candidate closest to fitting (smallest shortfall; first on ties)
        key = self.layout_of(cand)
        shape = (f", attention_tp={cand.tp}" if cand.tp > 1 else "") + (f", attention_cp={cand.cp}" if cand.cp > 1
                                                                         else "")
        for n in names:
            if key not in self.why[n] or reason[0] < self.why[n][key][0]:
                self.why[n][key] = (reason[0], f"G={cand.G}, R={cand.R}{shape}: {reason[1]}")

    def excluded(self, name: str, picks: tuple[str, ...]) -> dict[str, str]:
        """Layouts this strategy could not use at this batch (a named reason for any jump)."""
        if name == PICK:  # excluded only where no zebra variant nor DistEP fits (Asym-EA's reason, last, is the
            # telling one), and a pipelined layout where DistEP does not fit in P stages
            zs = tuple(n for n in (DISTEP, ZEBRA_NO_EA, ZEBRA_GREEDY, ZEBRA, DISTEP_PP, ZEBRA_PP) if n in picks)
            reasons = {k: v[1] for n in zs for k, v in self.why[n].items()}
            return {k: v for k, v in sorted(reasons.items()) if not any(k in self.fitted[n] for n in zs)}
        return {k: v[1] for k, v in sorted(self.why[name].items()) if k not in self.fitted[name]}


def _start(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, asym: str, engine: str,
           activation_checkpointing: bool, expert_recompute: str, attention_tp: tuple[int, ...] | None,
           distributed_optimizer: bool, pipeline_stages: tuple[int, ...] | None, recompute_modules: frozenset[str],
           pick_schedules: tuple[str, ...] | None, keep_tried: bool,
           attention_cp: tuple[int, ...] | None = None) -> _Search:
    """search()'s arguments checked, and its cost model at each expert-recompute level it prices."""
    if asym not in ("optimal", "greedy", "none"):
        raise ValueError(f"asym={asym!r}; use 'optimal', 'greedy' or 'none'")
    if expert_recompute != "auto" and expert_recompute not in EXPERT_RECOMPUTE:
        raise ValueError(f"expert_recompute={expert_recompute!r}; use 'auto' or one of {EXPERT_RECOMPUTE}")
    allowed = set(pick_schedules or (ScheduleName.ZEBRA, ScheduleName.DISTEP))
    if not allowed:
        raise ValueError(f"model {model.name!r}: pick_schedules={list(pick_schedules or ())} names no schedule; "
                         f"give zebra, distep or both")
    p_try = tuple(pipeline_stages or PIPELINE_STAGES)
    bad_p = [P for P in p_try if P not in PIPELINE_STAGES]
    if bad_p:
        raise ValueError(f"pipeline_stages={bad_p}: the search tries {list(PIPELINE_STAGES)}")
    bad_cp = [cp for cp in attention_cp or () if cp not in ATTENTION_CP]
    if bad_cp:
        raise ValueError(f"attention_cp={bad_cp}: the search tries {list(ATTENTION_CP)}")
    profiles = load_profiles(set(cluster.gpu_types()))
    cost = CostModel(model.replace(seq_length=seq_len), profiles,
                     TrainSettings(seq_len, activation_checkpointing, distributed_optimizer=distributed_optimizer,
                                   recompute_modules=recompute_modules))
    levels = (heavier_expert_recompute(cost.settings.expert_recompute) if expert_recompute == "auto"
              else (expert_recompute,))
    costs = {lv: cost if lv == cost.settings.expert_recompute else
             CostModel(cost.model, profiles, dataclasses.replace(cost.settings, expert_recompute=lv)) for lv in levels}
    return _Search(model, cluster, seq_len, global_batch, asym, engine, distributed_optimizer, allowed, p_try,
                   tuple(attention_tp or ATTENTION_TP), tuple(attention_cp or ATTENTION_CP), cluster.gpu_types(), cost,
                   levels, costs, keep_tried)


def _refuse_indivisible_batches(s: _Search) -> None:
    """Every strategy's reason for a role split whose attention members (at every usable TP and CP
    size) cannot each get whole sequences of the global batch."""
    for attn, expert in _role_splits(s.cluster):
        ok = {tp * cp: (tp, cp) for tp, w in tp_sizes(s.cluster, s.model, s.seq_len, attn).items()
              if not w and tp in s.tp_try
              for cp, w_cp in cp_sizes(s.cluster, s.model, s.seq_len, attn, tp).items() if not w_cp and cp in s.cp_try}
        if ok and all(s.global_batch % (len(attn) // n) for n in ok):
            fewest = len(attn) // max(ok)  # attention members at the largest usable member size
            tp, cp = ok[max(ok)]  # of the pairs of one size the most TP (the dict keeps the last)
            shape = " x ".join([f"attention_tp {tp}"] * (tp > 1) + [f"attention_cp {cp}"] * (cp > 1))
            nor = f" nor of the {fewest} members of {shape}" if max(ok) > 1 else ""
            for n in VARIANTS:
                s.why[n][layout_name(s.types, attn, expert)] = (0.0,
                    f"global batch {s.global_batch} is not a multiple of the {len(attn)} attention ranks (each "
                    f"gets whole sequences){nor}; use a multiple of {fewest}")


def _price_pipelined(s: _Search, cand: Candidate) -> None:
    """A candidate with P > 1 stages: DistEP and zebra in its even layout (no Asym-EA), each at the
    lightest level at which every rank fits, then zebra with Asym-EA inside each stage."""
    lay = pipeline.even_layout(s.cost.model, s.types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.P,
                               cand.R, cand.tp, cand.cp)
    if _cp_cannot_beat(s, cand, lay):
        return
    for level in s.levels:
        short = pipeline.memory_shortfall(lay, s.costs[level], s.global_batch)
        if short is None:
            _price_distep_pipelined(s, cand, lay, level)
            break
        s.refuse((DISTEP_PP,), cand, short)
    left = zebra_configs(cand.R)  # each (waves, order) at the lightest level at which it fits
    for level in s.levels:
        fits = _zebra_fits(s, cand, lay, level, left)
        if fits:
            _price_zebra_pipelined(s, cand, lay, level, fits)
            priced = {W for W, _ in fits}
            left = [wo for wo in left if wo[0] not in priced]
        if not left:
            break
    if cand.member == 1 and s.asym != "none" and not _cannot_beat(s, cand, lay):
        for level in s.levels:  # zebra with Asym-EA inside each stage (optimal per stage)
            try:
                k = [x for i in range(cand.P)
                     for x in asym_ea.optimal(stage_asym_problem(s.costs[level], lay, i, s.global_batch))]
            except PlanError as e:
                s.refuse((ZEBRA_PP,), cand, (math.inf, f"Asym-EA inside the stages: {e} (expert recompute {level!r})"))
                continue
            if not any(k):
                break  # the even layout above, already priced
            plan = build_plan(s.model, s.types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R, k,
                              ScheduleName.ZEBRA, skeleton=True, pipeline_stages=cand.P)
            lay_ea = pipeline.layout_of_plan(plan, validate=False)
            fits = _zebra_fits(s, cand, lay_ea, level, zebra_configs(cand.R))
            if fits:
                _price_zebra_pipelined(s, cand, lay_ea, level, fits, k)
                break


def _price_distep_pipelined(s: _Search, cand: Candidate, lay: pipeline.PipelineLayout, level: str) -> None:
    """DistEP in P > 1 stages that fit: priced unless its bound cannot beat the best step of any
    strategy the pick takes (all candidates with one stage come before)."""
    s.fits(DISTEP_PP, cand)
    c, model = s.costs[level], s.model
    M, N = cand.stage_shape
    t = s.global_batch * c.settings.seq_len / (cand.G * M * cand.R)
    a_gpus = {s.types[r] for r in cand.attention_ranks[:M]}
    x_gpus = {s.types[r] for r in cand.expert_ranks[:N]}
    lb = pipeline.lower_bound(c, a_gpus, x_gpus, t, M * t * model.moe_router_topk / model.num_experts,
                              model.planned_num_moe_layers * math.ceil(model.num_experts / N), cand.P, cand.R, cand.tp,
                              cand.cp)
    bar = s.best_step()
    if bar is not None and lb >= bar:
        return  # cannot beat the pick so far
    res = pipeline.price(lay, c, s.cluster, s.global_batch)
    s.keep(DISTEP_PP, Option(res.step_time_s, res, cand, [0] * model.planned_num_moe_layers, ScheduleName.DISTEP,
                             level))


def _price_zebra_pipelined(s: _Search, cand: Candidate, lay: pipeline.PipelineLayout, level: str,
                           configs: list[tuple[int, str]], k: list[int] | None = None) -> None:
    """Zebra inside P > 1 stages (Asym-EA inside each stage where `k` places experts on the
    attention ranks; `lay` is then the plan's) in each of `configs` (zebra_waves, order), which
    fit: its task lists simulated unless its bound cannot beat the best step of any strategy
    the pick takes (the bound holds in either order: a stage's first group's forward comes
    first and its last group's backward last in both)."""
    s.fits(ZEBRA_PP, cand)
    c, model, cluster = s.costs[level], s.model, s.cluster
    M, N = cand.stage_shape
    t = s.global_batch * c.settings.seq_len / (cand.G * M * cand.R)
    a_gpus, x_gpus = {s.types[r] for r in cand.attention_ranks[:M]}, {s.types[r] for r in cand.expert_ranks[:N]}
    tpe = M * t * model.moe_router_topk / model.num_experts
    k = k or [0] * model.planned_num_moe_layers
    cheap = pipeline.zebra_bound_terms(c, cluster, a_gpus, x_gpus, t, tpe, lay, streams=False)
    full = None  # with them: only for a candidate the cheaper bound keeps
    for W, order in configs:  # groups of microbatches (plan.zebra_waves) and their order
        bar = s.best_step()
        bound = (c, cluster, a_gpus, x_gpus, t, tpe, lay, W)  # pipeline.zebra_lower_bound's arguments
        if bar is not None and pipeline.zebra_lower_bound(*bound, terms=cheap) >= bar:
            continue
        full = full or pipeline.zebra_bound_terms(c, cluster, a_gpus, x_gpus, t, tpe, lay)
        if bar is not None and pipeline.zebra_lower_bound(*bound, terms=full) >= bar:
            continue
        plan = build_plan(model, s.types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R, k,
                          ScheduleName.ZEBRA, skeleton=True, attention_tp=cand.tp, pipeline_stages=cand.P,
                          zebra_waves=W, zebra_wave_order=order, attention_cp=cand.cp)
        res = simulate_plan(plan, c, cluster, s.global_batch, engine=s.engine)
        if s.keep_tried and ScheduleName.ZEBRA in s.allowed:
            s.tried.append(Option(res.step_time_s, None, cand, list(k), ScheduleName.ZEBRA, level, (W, order)))
        s.keep(ZEBRA_PP, Option(res.step_time_s, res, cand, k, ScheduleName.ZEBRA, level, (W, order)))


def _zebra_fits(s: _Search, cand: Candidate, lay: pipeline.PipelineLayout, level: str,
                configs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The (zebra_waves, order) of `configs` to price at `level`: those whose stages fit in
    memory there, a W in 1F1B's order only where GPipe's does not fit (the orders' steps differ
    by a few percent; 1F1B's is there for memory). Where none fits, the lightest one's shortfall
    is the layout's reason."""
    c = s.costs[level]
    fits = [wo for wo in configs if pipeline.memory_shortfall(lay, c, s.global_batch, True, *wo) is None]
    fits = [(W, o) for W, o in fits if o == "gpipe" or (W, "gpipe") not in fits]
    if not fits:
        lightest = min(configs, key=lambda wo: cand.R // wo[0] * wave_warmup(wo[1], wo[0], cand.P, 0))
        s.refuse((ZEBRA_PP,), cand, pipeline.memory_shortfall(lay, c, s.global_batch, True, *lightest))
    return fits


def _cannot_beat(s: _Search, cand: Candidate, lay: pipeline.PipelineLayout) -> bool:
    """No zebra plan in these stages, whatever its experts' placement and waves, beats the best
    step so far: the bound of its attention pieces alone, in groups of one microbatch."""
    bar = s.best_step()
    if bar is None:
        return False
    M = cand.stage_shape[0]
    t = s.global_batch * s.cost.settings.seq_len / (cand.G * M * cand.R)
    a_gpus = {s.types[r] for r in cand.attention_ranks[:M]}
    return pipeline.zebra_lower_bound(s.cost, s.cluster, a_gpus, set(), t, 0.0, lay, cand.R,
                                      attention_only=True) >= bar


def _attention_post_step(s: _Search, cand: Candidate) -> float:
    """Seconds after a one-stage candidate's task lists that its step takes at least: an attention
    rank's post-step (simulator.build_problem), the all-reduce of its dense gradients over the
    attention ranks at its TP position (data x context parallel) and its optimizer step over its
    dense parameters (experts it holds only add to both), the fastest attention type's."""
    key = (id(cand.attention_ranks), cand.tp)
    if key not in s.posts:
        c = s.cost
        dense = c.non_expert_params_per_rank(cand.tp)
        links = Links.for_ranks(s.cluster, cand.attention_ranks[0::cand.tp], c.profiles)
        s.posts[key] = allreduce_time(links, dense * c.settings.dtype_bytes) + min(
            c.optimizer_time(g, dense) for g in {s.types[r] for r in cand.attention_ranks})
    return s.posts[key]


def _cp_cannot_beat(s: _Search, cand: Candidate, lay: pipeline.PipelineLayout | None = None) -> bool:
    """A CP candidate (cp > 1) that no strategy it may take can use: its bound, at the lightest
    expert-recompute level priced (no level's step is shorter), is no less than the best step of
    each strategy it competes in: one stage, DistEP's row (compute_lower_bound under DistEP) and
    zebra without Asym-EA's (under zebra), each with the attention ranks' post-step
    (_attention_post_step); pipeline stages (`lay`), the best step of all (DistEP's 1F1B bound and
    zebra's bound of the even layout in waves of one microbatch, the least of any waves, each with
    the layout's post-step). The search skips such a candidate before its memory check, so where
    CP only adds K/V exchanges (short sequences) its candidates cost little time; a skipped
    candidate names no reason for its layout."""
    if cand.cp == 1:
        return False
    c = s.costs[s.levels[0]]
    if lay is None:
        if DISTEP not in s.best or ZEBRA_NO_EA not in s.best:
            return False
        zero = [0] * s.model.planned_num_moe_layers
        post = _attention_post_step(s, cand)
        return all(compute_lower_bound(c, s.types, cand, s.global_batch, zero, s.cluster, schedule) + post
                   >= s.best[name].step_s for name, schedule in ((DISTEP, ScheduleName.DISTEP),
                                                                  (ZEBRA_NO_EA, ScheduleName.ZEBRA)))
    bar = s.best_step()
    if bar is None:
        return False
    model = s.model
    M, N = cand.stage_shape
    t = s.global_batch * c.settings.seq_len / (cand.G * M * cand.R)
    a_gpus = {s.types[r] for r in cand.attention_ranks[:M]}
    x_gpus = {s.types[r] for r in cand.expert_ranks[:N]}
    distep = pipeline.lower_bound(c, a_gpus, x_gpus, t, M * t * model.moe_router_topk / model.num_experts,
                                  model.planned_num_moe_layers * math.ceil(model.num_experts / N), cand.P, cand.R,
                                  cand.tp, cand.cp)
    key = (id(cand.attention_ranks), id(cand.expert_ranks), cand.G, cand.P, cand.tp)
    if key not in s.posts:  # what follows the pipeline under either schedule: the same at any R and cp
        s.posts[key] = pipeline.post_step(lay, c, s.cluster)
    post = s.posts[key]
    if distep + post < bar:
        return False
    tpe = M * t * model.moe_router_topk / model.num_experts
    # zebra: experts as the even layout places them (the search has no Asym-EA with CP), in waves of one microbatch
    # (R / W x the stages before the last: the least of any W), first without the streams' load (cheap)
    for streams in (False, True):
        terms = pipeline.zebra_bound_terms(c, s.cluster, a_gpus, x_gpus, t, tpe, lay, streams=streams)
        if pipeline.zebra_lower_bound(c, s.cluster, a_gpus, x_gpus, t, tpe, lay, cand.R, terms=terms) + post >= bar:
            return True
    return False


def _price_one_stage(s: _Search, cand: Candidate) -> None:
    """A candidate with one stage: DistEP, zebra without Asym-EA and (one-rank members: no TP nor
    CP) with it, optimal and the paper's greedy, each at the lightest level at which it fits,
    heavier levels only where memory binds."""
    if _cp_cannot_beat(s, cand):
        return
    model, types, gb = s.model, s.types, s.global_batch
    M, N = len(cand.attention_ranks) // cand.G, len(cand.expert_ranks) // cand.G
    grp_a, grp_x = cand.attention_ranks[:M], cand.expert_ranks[:N]
    a_gpu, x_gpu = types[grp_a[0]], types[grp_x[0]]
    zero = [0] * model.planned_num_moe_layers
    distep_fits = False
    for level in s.levels:  # lightest first; a heavier level only where memory binds at this one
        c = s.costs[level]
        full = asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, gb, forward_only=False, tp=cand.tp, cp=cand.cp)
        # DistEP keeps one microbatch alive, so it is checked on its own memory rule
        one = asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, gb, forward_only=False,
                           microbatches_alive=1, tp=cand.tp, cp=cand.cp)
        if not distep_fits:
            if asym_ea.memory_ok(one, zero):
                _price(s, DISTEP, cand, zero, ScheduleName.DISTEP, level)
                distep_fits = True
            else:
                s.refuse((DISTEP,), cand, _memory_reason(one, zero, a_gpu, x_gpu, 1, level))
        if full.n_max < 0:
            s.refuse((ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA), cand, _memory_reason(full, zero, a_gpu, x_gpu, cand.R, level))
            break  # attention ranks cannot hold the non-expert model and activations; heavier levels add to them
        no_ea_fits = asym_ea.memory_ok(full, zero)
        if no_ea_fits:
            _price(s, ZEBRA_NO_EA, cand, zero, ScheduleName.ZEBRA, level)
        else:
            s.refuse((ZEBRA_NO_EA,), cand, _memory_reason(full, zero, a_gpu, x_gpu, cand.R, level))
        if cand.member > 1:  # the search tries no Asym-EA on TP members (the runtime runs it; the 1,024-GPU
            # search spent 3 s more simulating such candidates, none of which won), nor on CP ones (likewise)
            if no_ea_fits:
                break
            continue
        if s.asym != "none":
            try:
                _price(s, ZEBRA, cand, asym_ea.optimal(full) if s.asym == "optimal" else asym_ea.gather_squeeze(
                    asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, gb, forward_only=True)),
                    ScheduleName.ZEBRA, level)
            except PlanError as e:
                s.refuse((ZEBRA,), cand, (math.inf, f"{e} (expert recompute {level!r})"))
        if s.asym == "optimal" and (N % M == 0 or M % N == 0):
            try:
                fwd = asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, gb, forward_only=True)
                _price(s, ZEBRA_GREEDY, cand, asym_ea.gather_squeeze(fwd), ScheduleName.ZEBRA, level)
            except PlanError as e:
                s.refuse((ZEBRA_GREEDY,), cand, (math.inf, f"{e} (expert recompute {level!r})"))
        if no_ea_fits:
            break  # memory does not bind: keeping less would only cost time


def _price(s: _Search, name: str, cand: Candidate, k: list[int], schedule: ScheduleName, level: str) -> None:
    """A one-stage candidate that fits for strategy `name`: simulated unless its busiest rank's
    compute alone cannot beat the strategy's best so far."""
    s.fits(name, cand)
    c = s.costs[level]
    if name in s.best and compute_lower_bound(c, s.types, cand, s.global_batch, k, s.cluster,
                                              schedule) >= s.best[name].step_s:
        return
    plan = build_plan(s.model, s.types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R, k, schedule,
                      skeleton=True, attention_tp=cand.tp,
                      attention_cp=cand.cp)  # the chosen plan is rebuilt in full (_chosen_plan)
    res = simulate_plan(plan, c, s.cluster, s.global_batch, engine=s.engine)
    if s.keep_tried and schedule in s.allowed:
        s.tried.append(Option(res.step_time_s, None, cand, list(k), schedule, level))
    s.keep(name, Option(res.step_time_s, res, cand, k, schedule, level))


def _pick(s: _Search) -> tuple[str, ...]:
    """The planner keeps the fastest option of the strategies the pick may take (any zebra
    assignment, or DistEP at any pipeline size) as best[PICK]; returns those strategies."""
    picks = tuple(n for n in VARIANTS if SCHEDULE_OF[n] in s.allowed)
    options = [s.best[n] for n in picks if n in s.best]
    if options:
        s.best[PICK] = min(options, key=lambda o: o.step_s)
    return picks


def _strategy_rows(s: _Search, picks: tuple[str, ...], roof: BaselineResult,
                   cands: list[Candidate]) -> list[Prediction]:
    """The rows of HeterMoE's strategies: each one's fastest option, or why it has none."""
    rows = []
    for name in (PICK, ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA, DISTEP):
        opt = s.best.get(name)
        if opt is not None:
            cand, res = opt.candidate, opt.result
            M, N = cand.stage_shape
            extra = dict(res.detail) if isinstance(res, pipeline.PipelineResult) else {}
            rows.append(_pred(name, res, roof.tokens_per_s, {
                **extra,
                "M": M, "N": N, "groups": cand.G, "microbatches": cand.R, "expert_recompute": opt.expert_recompute,
                "attention_tp": cand.tp, "attention_cp": cand.cp, "pipeline_stages": cand.P,
                "zebra_waves": opt.waves[0],
                "zebra_wave_order": opt.waves[1],
                "attention_gpu": s.types[cand.attention_ranks[0]],
                "experts_on_attention_per_layer": list(opt.experts_on_attention),
                "attention_ranks": list(cand.attention_ranks), "expert_ranks": list(cand.expert_ranks),
                "schedule": opt.schedule, "layout": s.layout_of(cand),
                "post_step_s": res.step_time_s - res.makespan_s, "excluded_layouts": s.excluded(name, picks)}))
            continue
        skipped = (name == ZEBRA and s.asym == "none") or (name == ZEBRA_GREEDY and s.asym != "optimal")
        reason = f"not searched with asym={s.asym!r}" if skipped else "no candidate fits in memory"
        if name != PICK and 1 not in s.p_try:
            reason = f"not searched with pipeline_stages={list(s.p_try)}: this strategy runs one stage"
        elif name == PICK and not any(not w for w in pipeline_sizes(s.model, s.p_try).values()):
            reason = "no pipeline size can split this model: " + "; ".join(
                f"{P}: {w}" for P, w in pipeline_sizes(s.model, s.p_try).items())
        elif not cands:
            reason = (f"no ZP group shape with pipeline_stages in {list(s.p_try)}, attention_tp in "
                      f"{list(s.tp_try)} and attention_cp in {list(s.cp_try)} gives every attention member whole "
                      f"sequences of the global batch {s.global_batch}")
        rows.append(Prediction(name, float("inf"), 0.0, {}, 0.0, False,
                               {"reason": reason, "excluded_layouts": s.excluded(name, picks)}))
    return rows


def _baseline_rows(s: _Search, limit: BaselineResult) -> list[Prediction]:
    """The baselines on the same GPUs: Megatron EP (simulated, ideal, at its best TP x PP, and on
    the newest GPUs alone) and heterogeneous pipeline parallelism, against the compute-only limit."""
    cost, cluster, gb = s.cost, s.cluster, s.global_batch
    rows = [_pred(res.name, res, limit.tokens_per_s)
            for res in (simulate_ep(cost, cluster, gb), simulate_ep_ideal(cost, cluster, gb),
                        simulate_hetero_pp(cost, cluster, gb))]
    megatron = [best_megatron_ep(cost, cluster, gb)]
    if len(cluster.counts()) > 1:
        new = newest_gpu(cost, cluster)
        megatron.append(best_megatron_ep(cost, cluster, gb, cluster.ranks_of(new),
                                         f"Megatron EP on {new} alone (best TP/PP)"))
    return rows + [_pred(res.name, res, limit.tokens_per_s) for res in megatron]


def _bound_rows(limit: BaselineResult, net: BaselineResult, roof: BaselineResult) -> list[Prediction]:
    """The bounds' rows: "vs limit" is each one's share of the roofline."""
    return [Prediction(bound.name, bound.step_time_s, bound.tokens_per_s, {},
                       bound.step_time_s / roof.step_time_s if roof.step_time_s > 0 else 0.0, True,
                       dict(bound.detail)) for bound in (limit, net, roof)]


def _chosen_plan(s: _Search, picks: tuple[str, ...], preds: list[Prediction]) -> HeteroPlan:
    """best[PICK]'s plan in full, with what its expert holders keep, and its meta: how it was chosen,
    each role's most loaded rank's memory (also the pick's row's detail["memory"]) and every row's
    predicted step."""
    pick = s.best[PICK]
    cand, level, (W, order) = pick.candidate, pick.expert_recompute, pick.waves
    plan = build_plan(s.model, s.types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R,
                      pick.experts_on_attention, pick.schedule, attention_tp=cand.tp, pipeline_stages=cand.P,
                      zebra_waves=W, zebra_wave_order=order, attention_cp=cand.cp)
    plan.expert_recompute = level  # what its expert holders keep for backward, as priced
    source = next(n for n in picks if s.best.get(n) is pick)
    if source == DISTEP_PP:
        source = f"DistEP in {cand.P} pipeline stages (1F1B), no Asym-EA"
    elif source == ZEBRA_PP:
        ea = "Asym-EA (optimal) inside each stage" if any(pick.experts_on_attention) else "no Asym-EA"
        source = (f"zebra in {cand.P} pipeline stages ({W} wave(s) of microbatches"
                  f"{', in 1F1B order' if order == '1f1b' else ''}), {ea}")
    lay = pipeline.layout_of_plan(plan, validate=False)
    memory = {}  # role -> its most loaded rank over the stages: GPU type, GiB and usable GiB
    for row in pipeline.pipeline_memory(lay, s.costs[level], s.global_batch, pick.schedule == ScheduleName.ZEBRA,
                                        W, order):
        for role in ("attention", "expert"):
            if role in row and (role not in memory or row[role]["bytes"] > memory[role]["GiB"] * 2**30):
                memory[role] = {"gpu": row[role]["gpu"], "GiB": row[role]["bytes"] / 2**30,
                                "usable_GiB": row[role]["usable"] / 2**30}
    next(p for p in preds if p.name == PICK).detail["memory"] = memory
    plan.meta = {
        "model": s.model.name, "cluster": s.cluster.name, "seq_len": s.seq_len, "global_batch": s.global_batch,
        "distributed_optimizer": s.distributed_optimizer, "memory_per_rank": memory,
        "assignment": source, "experts_on_attention_per_layer": list(pick.experts_on_attention),
        "predicted": {p.name: {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s}
                      for p in preds if p.fits},
    }
    return plan


@_cyclic_gc_paused
def search(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, asym: str = "optimal",
           engine: str = "auto", max_microbatches: int = 32, baselines: bool = True,
           activation_checkpointing: bool = True, expert_recompute: str = "auto",
           attention_tp: tuple[int, ...] | None = None, distributed_optimizer: bool = False,
           pipeline_stages: tuple[int, ...] | None = None, recompute_modules: frozenset[str] = frozenset(),
           micro_batch_size: int | None = None, pick_schedules: tuple[str, ...] | None = None,
           expert_load: ExpertLoad | None = None, expert_speeds: ExpertSpeeds | None = None,
           attention_cp: tuple[int, ...] | None = None) -> SearchResult:
    """Best HeterMoE plan for the cluster, with every strategy's predicted step.
    `expert_recompute`: what expert holders keep for backward (cost_model.EXPERT_RECOMPUTE), or
    'auto': the settings' default level (keep-inputs with activation checkpointing, else off)
    and, for a candidate whose expert ranks cannot hold every expert without Asym-EA at that
    level, each level that keeps less, up to the first where they can; each strategy keeps its
    fastest simulated (candidate, level). `attention_tp`: the attention members' TP sizes to try
    (default ATTENTION_TP; a candidate with TP > 1 holds no experts on attention ranks, so only
    zebra without Asym-EA and DistEP use it). `attention_cp`: the attention members' CP sizes to try
    (default ATTENTION_CP where cp_sizes allows them; no Asym-EA either). `distributed_optimizer`: price Megatron's
    --use-distributed-optimizer (optimizer state sharded over each parameter's replicas).
    `pipeline_stages`: the pipeline sizes to try (default PIPELINE_STAGES; module docstring): the
    zebra and DistEP rows are one stage (searched when 1 is in it), P > 1 runs DistEP or zebra in
    the stages and competes for the pick. `recompute_modules`: Megatron's selective recomputation
    (TrainSettings.recompute_modules). `micro_batch_size`: the run's --micro-batch-size (R is then
    each member's sequences / it). `pick_schedules`: the schedules the pick may use (default: both);
    every row is priced either way. `expert_load`: measured loads (planner/expert_load.py): the
    search runs as without them (balanced routing), then its LOAD_CANDIDATES fastest simulated
    candidates the pick could take (at a level the runtime runs, where the pick's is one) get the
    load-aware placement (planner/load_placement.py,
    expert times scaled by `expert_speeds`), and the plan is the one predicted fastest under the
    loads, where that beats the pick's own placement under them (rows LOAD_UNIFORM and LOAD_AWARE,
    SearchResult.expert_load). DistEP in pipeline stages is not priced under loads (its 1F1B model
    takes none): such a pick stays as it is."""
    t0 = time.perf_counter()
    s = _start(model, cluster, seq_len, global_batch, asym, engine, activation_checkpointing, expert_recompute,
               attention_tp, distributed_optimizer, pipeline_stages, recompute_modules, pick_schedules,
               keep_tried=expert_load is not None, attention_cp=attention_cp)
    limit = physical_limit(s.cost, cluster, global_batch)
    _refuse_indivisible_batches(s)
    cands = candidates(cluster, model, global_batch, max_microbatches, seq_len, s.tp_try, s.p_try, micro_batch_size,
                       s.cp_try)
    for cand in cands:
        if cand.P > 1:
            _price_pipelined(s, cand)
        else:
            _price_one_stage(s, cand)
    picks = _pick(s)
    net = network_limit(s.cost, cluster, global_batch, list(s.fit_layouts.values()), limit)
    roof = roofline(limit, net)  # what HeterMoE's disaggregated layouts can reach; baselines: compute only
    preds = _strategy_rows(s, picks, roof, cands) + (_baseline_rows(s, limit) if baselines else [])
    preds += _bound_rows(limit, net, roof)
    plan = _chosen_plan(s, picks, preds) if PICK in s.best else None
    report = None
    if expert_load is not None and plan is not None:
        plan, report = _replan_for_load(model, s.types, cluster, s.costs, global_batch, plan, s.best[PICK], s.tried,
                                        preds, roof.tokens_per_s, expert_load, expert_speeds, engine)
    return SearchResult(plan, preds, len(cands), time.perf_counter() - t0, report)


def _replan_for_load(model: ModelConfig, types: list[str], cluster: Cluster, costs: dict[str, CostModel],
                     global_batch: int, pick: HeteroPlan, pick_option: Option, tried: list[Option],
                     preds: list[Prediction], roof_tps: float, load: ExpertLoad, speeds: ExpertSpeeds | None,
                     engine: str) -> tuple[HeteroPlan, dict]:
    """search()'s step with measured loads (its docstring): the plan to write and the report. Adds
    the rows LOAD_UNIFORM and LOAD_AWARE after the HeterMoE strategies' rows."""
    level = pick_option.expert_recompute
    try:
        own = place_for_load(pick, costs[level], cluster, global_batch, load, speeds, engine)
    except PlanError as e:  # DistEP in pipeline stages: no step model with loads
        report = {"placement": "uniform", "not_priced": str(e)}
        pick.meta["expert_load"] = report
        return pick, report
    seen = {(id(pick_option.candidate), tuple(pick_option.experts_on_attention), pick_option.schedule, level,
             (pick.zebra_waves, pick.zebra_wave_order))}
    found: list[tuple[LoadPlacement, Option]] = [(own, pick_option)]
    runs = level in RUNTIME_EXPERT_RECOMPUTE  # a pick that trains is replaced only by a plan that trains
    for opt in sorted(tried, key=lambda o: o.step_s):
        if len(seen) >= LOAD_CANDIDATES:
            break
        cand, lv = opt.candidate, opt.expert_recompute
        key = (id(cand), tuple(opt.experts_on_attention), opt.schedule, lv, opt.waves)
        if key in seen or (runs and lv not in RUNTIME_EXPERT_RECOMPUTE):
            continue
        seen.add(key)
        plan = build_plan(model, types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R,
                          opt.experts_on_attention, opt.schedule, attention_tp=cand.tp, pipeline_stages=cand.P,
                          zebra_waves=opt.waves[0], zebra_wave_order=opt.waves[1], attention_cp=cand.cp)
        plan.expert_recompute = lv
        found.append((place_for_load(plan, costs[lv], cluster, global_batch, load, speeds, engine), opt))
    best, chosen = min(found, key=lambda f: min(f[0].uniform_step_s, f[0].load_aware_step_s))
    step = min(best.uniform_step_s, best.load_aware_step_s)
    take = step < own.uniform_step_s
    plan = best.plan if take else pick
    g0 = plan.groups[0]
    report = {**own.to_dict(), "placement": "load-aware" if take else "uniform", "load_aware_step_s": step,
              "gain": own.uniform_step_s / step if take else 1.0, "candidates_priced": len(found),
              "load_aware_shape": {"M": len(g0.attention_ranks) // plan.pipeline_stages,
                                   "N": len(g0.expert_ranks) // plan.pipeline_stages, "groups": len(plan.groups),
                                   "microbatches": plan.num_microbatches, "schedule": plan.schedule,
                                   "pipeline_stages": plan.pipeline_stages,
                                   "expert_recompute": chosen.expert_recompute},
              "experts_on_attention_per_layer": plan.experts_on_attention_per_layer(),
              "same_shape_as_pick": best is own}
    tokens = best.tokens_per_step
    rows = [Prediction(LOAD_UNIFORM, own.uniform_step_s, tokens / own.uniform_step_s, dict(own.uniform_util),
                       tokens / own.uniform_step_s / roof_tps if roof_tps else 0.0, True,
                       {"placement": "the pick's, as without loads", "fits": own.uniform_fits}),
            Prediction(LOAD_AWARE, step, tokens / step, dict(best.load_aware_util if take else own.uniform_util),
                       tokens / step / roof_tps if roof_tps else 0.0, True,
                       {"placement": report["placement"], "shape": report["load_aware_shape"],
                        "experts_on_attention_per_layer": report["experts_on_attention_per_layer"]})]
    at = max(i for i, p in enumerate(preds) if p.name in (PICK, ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA, DISTEP)) + 1
    preds[at:at] = rows
    if take:
        meta = dict(pick.meta)
        meta["assignment"] = f"{meta.get('assignment')}; experts re-placed for the measured loads"
        meta["experts_on_attention_per_layer"] = report["experts_on_attention_per_layer"]
        if not report["same_shape_as_pick"]:
            meta["assignment"] += " (from another of the search's candidates: " + ", ".join(
                f"{k} {v}" for k, v in report["load_aware_shape"].items()) + ")"
            meta.pop("memory_per_rank", None)  # the pick's; this shape's is the load-aware problem's
        plan.meta = meta
        plan.expert_recompute = chosen.expert_recompute
    plan.meta["expert_load"] = report
    plan.meta.setdefault("predicted", {}).update(
        {p.name: {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s} for p in rows})
    return plan, report
