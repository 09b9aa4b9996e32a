"""Plan search: pick the ZP group shape (M:N, number of groups), the microbatch count R and the
expert placement for a cluster and model, by simulating every candidate; and predict every
baseline on the same cost model, for the report.

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
When a role split has no candidate that fits (or none that divides the batch), the strategy's
prediction names it in detail["excluded_layouts"] ({layout name: reason}); a strategy that
falls back to a slower layout at a larger batch says why there (e.g. O1, D1, 20K tokens, expert
ranks keeping their inputs: from global batch 84 on, V100s cannot hold 32 experts plus every
microbatch's routed tokens, so zebra without Asym-EA must put attention on the V100s;
planner/HETERO_PP.md, "Smoothness"; with 'resend-inputs' it keeps attention on the A40s).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, ZPGroup
from megatron_hetermoe.planner import asym_ea
from megatron_hetermoe.planner.baselines import (
    BaselineResult,
    physical_limit,
    simulate_ep,
    simulate_ep_ideal,
    simulate_hetero_pp,
)
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import (
    EXPERT_RECOMPUTE,
    CostModel,
    TrainSettings,
    heavier_expert_recompute,
)
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.simulator import simulate_plan

PICK = "HeterMoE (planner's pick)"
ZEBRA = "Zebra + Asym-EA (optimal)"
ZEBRA_GREEDY = "Zebra + Asym-EA (paper's greedy)"
ZEBRA_NO_EA = "Zebra (no Asym-EA)"
DISTEP = "DistEP"


@dataclass
class Prediction:
    name: str
    step_time_s: float
    tokens_per_s: float
    utilization: dict[str, float] = field(default_factory=dict)
    ratio_to_limit: float = 0.0  # tokens/s over the physical limit's tokens/s
    fits: bool = True
    detail: dict = field(default_factory=dict)


@dataclass
class SearchResult:
    plan: HeteroPlan | None
    predictions: list[Prediction]
    candidates: int
    elapsed_s: float

    def by_name(self) -> dict[str, Prediction]:
        return {p.name: p for p in self.predictions}

    def to_dict(self) -> dict:
        return {"strategies": [asdict(p) for p in self.predictions], "candidates": self.candidates,
                "elapsed_s": self.elapsed_s, "plan": self.plan.to_dict() if self.plan else None}


@dataclass
class Candidate:
    attention_ranks: list[int]
    expert_ranks: list[int]
    G: int
    R: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_name(gpu_types: list[str], attn: list[int], expert: list[int]) -> str:
    """Name of a role split, as detail["layout"] and the keys of detail["excluded_layouts"] give it."""
    def side(ranks: list[int]) -> str:
        counts: dict[str, int] = {}
        for r in ranks:
            counts[gpu_types[r]] = counts.get(gpu_types[r], 0) + 1
        return " + ".join(f"{n} {g}" for g, n in counts.items())
    return f"attention on {side(attn)}, experts on {side(expert)}"


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
                 global_batch: int, forward_only: bool, microbatches_alive: int | None = None) -> asym_ea.AsymProblem:
    """Asym-EA inputs for one ZP group shape: per-microbatch times (forward, or forward+backward)
    and memory limits, from the cost model. Mixed types on one side: the slowest / smallest.
    `microbatches_alive`: microbatches whose activations coexist (zebra: R, the default; DistEP: 1)."""
    alive = R if microbatches_alive is None else microbatches_alive
    if not 1 <= alive <= R:
        raise ValueError(f"microbatches_alive={alive} must be in 1..R={R} (zebra: R, DistEP: 1)")
    m = cost.model
    L, E, k = m.num_moe_layers, m.num_experts, m.moe_router_topk  # stage l < L: MoE layer l (+ its dense layers)
    M, N = len(attn), len(expert)
    t_mb = global_batch * cost.settings.seq_len / (G * M * R)
    tpe = M * t_mb * k / E
    a_gpus = sorted({gpu_types[r] for r in attn})
    x_gpus = sorted({gpu_types[r] for r in expert})

    def both(f, *args) -> float:
        return f(*args, False) + (0.0 if forward_only else f(*args, True))

    t_attn = tuple(max(both(cost.stage_time, g, l, t_mb) for g in a_gpus) for l in range(L))
    extra = max(both(cost.stage_time, g, L, t_mb) for g in a_gpus)
    t_exp = max(both(cost.expert_time, g, tpe) for g in x_gpus)
    t_x = max(both(cost.expert_time, g, tpe) for g in a_gpus)
    per = cost.per_expert_bytes(tpe, alive)
    work = cost.expert_working_bytes(tpe)
    free_a = min(cost.profile(g).usable_memory_bytes for g in a_gpus) - cost.attention_rank_bytes(t_mb, alive) - work
    free_x = min(cost.profile(g).usable_memory_bytes for g in x_gpus) - work
    n_max = math.floor(free_a / per) if free_a >= 0 else -1
    cap_x = max(0, math.floor(free_x / per))
    return asym_ea.AsymProblem(L, E, M, N, t_attn, t_exp, t_x, n_max, cap_x, extra)


def build_plan(model: ModelConfig, gpu_types: list[str], attn: list[int], expert: list[int], G: int, R: int,
               k: list[int], schedule: str = "zebra", validate: bool = True, skeleton: bool = False) -> HeteroPlan:
    """G groups of M attention + N expert ranks (consecutive in `attn` / `expert`), experts placed
    by asym_ea.placement(k) (one entry per MoE layer) alike in every group; the model's dense
    layers are the plan's dense_layers. `skeleton`: only group 0 gets a placement (the
    simulator reads no other); such a plan is for simulation inside the search only."""
    M, N = len(attn) // G, len(expert) // G
    local = asym_ea.placement(k, model.num_experts, list(range(M)), list(range(M, M + N)))
    groups = []
    for g in range(G):
        a, x = attn[g * M:(g + 1) * M], expert[g * N:(g + 1) * N]
        members = a + x
        pl = [] if skeleton and g else [{members[i]: list(es) for i, es in p.items()} for p in local]
        groups.append(ZPGroup(a, x, pl))
    plan = HeteroPlan(model.num_moe_layers, model.num_experts, list(gpu_types), groups, R, schedule,
                      dense_layers=model.dense_layers)
    if validate and not skeleton:
        plan.validate()
    return plan


def candidates(cluster: Cluster, model: ModelConfig, global_batch: int, max_microbatches: int = 32) -> list[Candidate]:
    out = []
    for attn, expert in _role_splits(cluster):
        if global_batch % len(attn):
            continue  # every attention rank gets whole sequences
        for G in _divisors(math.gcd(len(attn), len(expert))):
            if len(expert) // G > model.num_experts:
                continue
            spr = global_batch // len(attn)
            for R in _divisors(spr):
                if R <= max_microbatches:
                    out.append(Candidate(attn, expert, G, R))
    return out


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


def search(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, asym: str = "optimal",
           engine: str = "auto", max_microbatches: int = 32, baselines: bool = True,
           activation_checkpointing: bool = True, expert_recompute: str = "auto") -> SearchResult:
    """Best HeterMoE plan for the cluster, with every strategy's predicted step.
    `expert_recompute`: what expert holders keep for backward (cost_model.EXPERT_RECOMPUTE), or
    'auto': the settings' default level (keep-inputs with activation checkpointing, else off)
    and, for a candidate whose expert ranks cannot hold every expert without Asym-EA at that
    level, each level that keeps less, up to the first where they can; each strategy keeps its
    fastest simulated (candidate, level)."""
    if asym not in ("optimal", "greedy", "none"):
        raise ValueError(f"asym={asym!r}; use 'optimal', 'greedy' or 'none'")
    if expert_recompute != "auto" and expert_recompute not in EXPERT_RECOMPUTE:
        raise ValueError(f"expert_recompute={expert_recompute!r}; use 'auto' or one of {EXPERT_RECOMPUTE}")
    if model.mtp_num_layers:
        raise ValueError(f"model {model.name!r} has mtp_num_layers={model.mtp_num_layers}: the cost model does not "
                         f"price multi-token prediction layers; make an even plan for it")
    t0 = time.perf_counter()
    profiles = load_profiles(set(cluster.gpu_types()))
    cost = CostModel(model.replace(seq_length=seq_len), profiles, TrainSettings(seq_len, activation_checkpointing))
    levels = (heavier_expert_recompute(cost.settings.expert_recompute) if expert_recompute == "auto"
              else (expert_recompute,))
    costs = {lv: cost if lv == cost.settings.expert_recompute else
             CostModel(cost.model, profiles, dataclasses.replace(cost.settings, expert_recompute=lv)) for lv in levels}
    types = cluster.gpu_types()
    limit = physical_limit(cost, cluster, global_batch)
    best: dict[str, tuple] = {}  # strategy -> (step, result, candidate, k, schedule, expert recompute level)

    variants = (ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA, DISTEP)
    fitted: dict[str, set[str]] = {n: set() for n in variants}  # layouts with a candidate that fits
    why: dict[str, dict[str, tuple[float, str]]] = {n: {} for n in variants}  # layout -> (shortfall, why)

    def consider(name: str, cand: Candidate, k: list[int], schedule: str, level: str) -> None:
        plan = build_plan(model, types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R, k, schedule,
                          skeleton=True)  # the chosen plan is rebuilt in full below
        res = simulate_plan(plan, costs[level], cluster, global_batch, engine=engine)
        fitted[name].add(layout_name(types, cand.attention_ranks, cand.expert_ranks))
        if name not in best or res.step_time_s < best[name][0]:
            best[name] = (res.step_time_s, res, cand, k, schedule, level)

    def refuse(names: tuple[str, ...], cand: Candidate, reason: tuple[float, str]) -> None:
        # a layout's reason is its candidate closest to fitting (smallest shortfall; first on ties)
        key = layout_name(types, cand.attention_ranks, cand.expert_ranks)
        for n in names:
            if key not in why[n] or reason[0] < why[n][key][0]:
                why[n][key] = (reason[0], f"G={cand.G}, R={cand.R}: {reason[1]}")

    for attn, expert in _role_splits(cluster):
        if global_batch % len(attn):
            for n in variants:
                why[n][layout_name(types, attn, expert)] = (0.0,
                    f"global batch {global_batch} is not a multiple of the {len(attn)} attention ranks (each "
                    f"gets whole sequences); use a multiple of {len(attn)}")
    cands = candidates(cluster, model, global_batch, max_microbatches)
    for cand in cands:
        M, N = len(cand.attention_ranks) // cand.G, len(cand.expert_ranks) // cand.G
        grp_a, grp_x = cand.attention_ranks[:M], cand.expert_ranks[:N]
        a_gpu, x_gpu = types[grp_a[0]], types[grp_x[0]]
        zero = [0] * model.num_moe_layers
        distep_fits = False
        for level in levels:  # lightest first; a heavier level only where memory binds at this one
            c = costs[level]
            full = asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, global_batch, forward_only=False)
            # DistEP keeps one microbatch alive, so it is checked on its own memory rule
            one = asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, global_batch, forward_only=False,
                               microbatches_alive=1)
            if not distep_fits:
                if asym_ea.memory_ok(one, zero):
                    consider(DISTEP, cand, zero, "distep", level)
                    distep_fits = True
                else:
                    refuse((DISTEP,), cand, _memory_reason(one, zero, a_gpu, x_gpu, 1, level))
            if full.n_max < 0:
                refuse((ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA), cand, _memory_reason(full, zero, a_gpu, x_gpu, cand.R, level))
                break  # attention ranks cannot hold the non-expert model and activations; heavier levels add to them
            no_ea_fits = asym_ea.memory_ok(full, zero)
            if no_ea_fits:
                consider(ZEBRA_NO_EA, cand, zero, "zebra", level)
            else:
                refuse((ZEBRA_NO_EA,), cand, _memory_reason(full, zero, a_gpu, x_gpu, cand.R, level))
            if asym != "none":
                try:
                    consider(ZEBRA, cand, asym_ea.optimal(full) if asym == "optimal" else asym_ea.gather_squeeze(
                        asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, global_batch, forward_only=True)),
                        "zebra", level)
                except PlanError as e:
                    refuse((ZEBRA,), cand, (math.inf, f"{e} (expert recompute {level!r})"))
            if asym == "optimal" and (N % M == 0 or M % N == 0):
                try:
                    fwd = asym_problem(c, types, grp_a, grp_x, cand.G, cand.R, global_batch, forward_only=True)
                    consider(ZEBRA_GREEDY, cand, asym_ea.gather_squeeze(fwd), "zebra", level)
                except PlanError as e:
                    refuse((ZEBRA_GREEDY,), cand, (math.inf, f"{e} (expert recompute {level!r})"))
            if no_ea_fits:
                break  # memory does not bind: keeping less would only cost time
    zebras = [best[n] for n in (ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA) if n in best]
    if zebras:  # the planner keeps the fastest simulated zebra plan, whichever assignment made it
        best[PICK] = min(zebras, key=lambda b: b[0])

    def excluded(name: str) -> dict[str, str]:
        """Layouts this strategy could not use at this batch (a named reason for any jump)."""
        if name == PICK:  # excluded only where no zebra variant fits; Asym-EA's reason is the telling one
            zs = (ZEBRA_NO_EA, ZEBRA_GREEDY, ZEBRA)
            reasons = {k: v[1] for n in zs for k, v in why[n].items()}
            return {k: v for k, v in sorted(reasons.items()) if not any(k in fitted[n] for n in zs)}
        return {k: v[1] for k, v in sorted(why[name].items()) if k not in fitted[name]}

    preds: list[Prediction] = []
    for name in (PICK, ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA, DISTEP):
        if name in best:
            step, res, cand, k, plan, level = best[name]
            M, N = len(cand.attention_ranks) // cand.G, len(cand.expert_ranks) // cand.G
            preds.append(_pred(name, res, limit.tokens_per_s, {
                "M": M, "N": N, "groups": cand.G, "microbatches": cand.R, "expert_recompute": level,
                "attention_gpu": types[cand.attention_ranks[0]], "experts_on_attention_per_layer": list(k),
                "attention_ranks": list(cand.attention_ranks), "expert_ranks": list(cand.expert_ranks),
                "schedule": plan, "layout": layout_name(types, cand.attention_ranks, cand.expert_ranks),
                "post_step_s": res.step_time_s - res.makespan_s, "excluded_layouts": excluded(name)}))
        else:
            skipped = (name == ZEBRA and asym == "none") or (name == ZEBRA_GREEDY and asym != "optimal")
            reason = f"not searched with asym={asym!r}" if skipped else "no candidate fits in memory"
            preds.append(Prediction(name, float("inf"), 0.0, {}, 0.0, False,
                                    {"reason": reason, "excluded_layouts": excluded(name)}))
    if baselines:
        for res in (simulate_ep(cost, cluster, global_batch), simulate_ep_ideal(cost, cluster, global_batch),
                    simulate_hetero_pp(cost, cluster, global_batch)):
            preds.append(_pred(res.name, res, limit.tokens_per_s))
    preds.append(_pred(limit.name, limit, limit.tokens_per_s, {}))

    plan = None
    if PICK in best:
        _, _, cand, k, schedule, level = best[PICK]
        plan = build_plan(model, types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R, k, schedule)
        plan.expert_recompute = level  # what its expert holders keep for backward, as priced
        source = next(n for n in (ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA) if best.get(n) is best[PICK])
        plan.meta = {
            "model": model.name, "cluster": cluster.name, "seq_len": seq_len, "global_batch": global_batch,
            "assignment": source, "experts_on_attention_per_layer": list(best[PICK][3]),
            "predicted": {p.name: {"step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s}
                          for p in preds if p.fits},
        }
    return SearchResult(plan, preds, len(cands), time.perf_counter() - t0)
