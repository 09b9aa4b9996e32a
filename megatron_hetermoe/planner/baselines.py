"""Step-time models of the strategies HeterMoE is compared with (PAPER.md), on the same cost
model and transfer model as the zebra simulator:

* EP over all GPUs (Megatron alltoall): every rank holds the non-expert model and E/d experts
  of every layer (d = expert-parallel size), data split evenly over all ranks; the all-to-alls
  make each layer bulk-synchronous inside an EP group, so per layer the slowest member bounds.
  Gradient accumulation: the fewest microbatches whose one live microbatch fits.
* EP (Ideal): each GPU type trained alone with the same per-GPU batch; throughputs added.
  A type that cannot train alone is listed in detail["excluded_layouts"].
* Heterogeneity-aware PP (`simulate_hetero_pp`; planner/HETERO_PP.md has the derivation and the
  published systems it stands for):
  - stages: one per GPU type; all GPUs of a type form one stage and run it data-parallel, with
    expert parallelism inside the stage (EP size d = ep_size(stage GPUs, E)); every order of the
    types is tried (P <= 4), the first stage holds the embedding, the last the output layer+loss;
  - layers: every contiguous split of the L layers into P non-empty runs is tried (no
    proportional guess: the best simulated split wins); a stage's attention work is exactly the
    zebra stages it covers (cost_model.stage_time), so PP and HeterMoE count the same FLOPs;
  - microbatches: r divides the batch and each microbatch gives every GPU of every stage whole
    sequences (a microbatch is a multiple of lcm(GPUs per type) sequences), every such r tried;
  - schedule: 1F1B (PipeDream-flush, Megatron's default) with T_i = forward+backward of one
    microbatch on stage i, its EP all-to-alls and the activation/gradient transfer to the next
    stage, none overlapped: step = sum_i T_i + (r-1) max_i T_i (fill and drain once, then the
    slowest stage sets the pace), + gradient all-reduce inside each stage and the optimizer;
    bubble fraction = (sum_i T_i - max_i T_i) / step;
  - memory, per GPU of stage i: weights+Adam state of its layers (+ embedding / output layer),
    its experts with their routed tokens, checkpointed layer inputs for min(P-i, r) live
    microbatches (1F1B's in-flight count), one working set, fp32 logits on the last stage;
    a split that fits with no r is listed in detail["excluded_layouts"];
  - idealisations: stages of unequal GPU counts (O2: 4 A40 -> 8 V100) are allowed, which real
    Megatron PP (equal DP per stage) is not; p2p transfers are not overlapped (pessimistic).
* Megatron EP with TP and PP (`simulate_megatron_ep`, `best_megatron_ep`): TP in 1, 2, 4, 8 with
  sequence parallelism (expert TP 1; TP priced as on HeterMoE's attention members), PP in 1, 2, 4, 8
  in Megatron's rank order (stage i = the i-th block of W/PP ranks, even layer split), 1F1B with
  P2P sends; TP 1 x PP 1 is `simulate_ep`. The search reports the best on all GPUs and on the
  fastest GPU type alone.
* Physical limit: compute only; attention and expert work of the step split fractionally over
  GPU types to minimise the makespan (an LP; for two kinds of work the optimum gives attention to
  the types with the smallest attention/expert time ratio first), every GPU busy all step, each
  piece at its cheapest per-token call size (so no strategy's call can beat it).
Every strategy prices the same model: L counts MoE layers (the zebra stages' L), and the dense
layers and shared experts of a model with them (--moe-layer-freq, --moe-shared-expert-intermediate-size)
are inside cost_model.stage_time and ModelConfig.non_expert_params, so EP and PP run and hold them
as HeterMoE's attention ranks do (EP's memory keeps every layer's input, dense ones too: Megatron's
full recompute is per layer, zebra's per stage).
Each returns a BaselineResult, or one with `fits=False` and the reason.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from itertools import combinations, permutations
from typing import Callable

from megatron_hetermoe.planner.cluster import (
    Cluster,
    Links,
    allreduce_time,
    rank1_collective_time,
)
from megatron_hetermoe.planner.cost_model import BYTES_PER_PARAM_STATE, CostModel


@dataclass
class BaselineResult:
    name: str
    step_time_s: float
    tokens_per_s: float
    utilization: dict[str, float] = field(default_factory=dict)
    detail: dict = field(default_factory=dict)
    fits: bool = True
    reason: str = ""

    @classmethod
    def infeasible(cls, name: str, reason: str) -> "BaselineResult":
        return cls(name, float("inf"), 0.0, {}, {}, False, reason)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_size(world: int, num_experts: int) -> int:
    """Largest d dividing both the world size and the expert count (Megatron: E % EP == 0, EP | DP)."""
    return max(d for d in _divisors(world) if num_experts % d == 0)


def ep_a2a_time(cost: CostModel, cluster: Cluster, ranks: list[int], t: float) -> float:
    """One token all-to-all of an EP group, t tokens per rank routed evenly (top-k copies)."""
    links = Links.for_ranks(cluster, ranks, cost.profiles)
    n = len(ranks)
    return rank1_collective_time(links, [t] * n, [1.0 / n] * n, cost.model.moe_router_topk * cost.token_bytes())


def _ep_group_mb_time(cost: CostModel, cluster: Cluster, ranks: list[int], gpus: list[str], d: int,
                      t: float) -> tuple[float, dict[int, float]]:
    """Forward+backward of one microbatch of t tokens per rank through an EP group (bulk
    synchronous per layer); also each rank's busy compute time."""
    m = cost.model
    L, E, k = cost.num_layers, m.num_experts, m.moe_router_topk  # MoE layers; stages hold the dense ones
    a2a = ep_a2a_time(cost, cluster, ranks, t)
    per_expert = d * t * k / E
    busy = {r: 0.0 for r in ranks}
    total = 0.0
    for bwd in (False, True):
        for s in range(L + 1):
            st = [cost.stage_time(g, s, t, bwd) for g in gpus]
            total += max(st)
            for r, x in zip(ranks, st):
                busy[r] += x
        for _ in range(L):
            et = [(E // d) * cost.expert_time(g, per_expert, bwd) for g in gpus]
            total += max(et) + 2 * a2a
            for r, x in zip(ranks, et):
                busy[r] += x
    return total, busy


def simulate_ep(cost: CostModel, cluster: Cluster, global_batch: int, ranks: list[int] | None = None,
                name: str = "EP") -> BaselineResult:
    m = cost.model
    S = cost.settings.seq_len
    types = cluster.gpu_types()
    ranks = list(range(cluster.world_size)) if ranks is None else ranks
    W = len(ranks)
    if global_batch % W:
        return BaselineResult.infeasible(name, f"global batch {global_batch} is not a multiple of {W} ranks")
    d = ep_size(W, m.num_experts)
    spr = global_batch // W
    per_rank_experts = cost.num_layers * (m.num_experts // d)
    for r_mb in _divisors(spr):  # fewest microbatches that fit
        t = spr // r_mb * S
        per_expert_tokens = d * t * m.moe_router_topk / m.num_experts
        need = (cost.attention_rank_bytes(t, 1, layer_checkpoints=True)
                + per_rank_experts * cost.per_expert_bytes(per_expert_tokens, 1)
                + cost.expert_working_bytes(per_expert_tokens))
        if all(need <= cost.profile(types[r]).usable_memory_bytes for r in ranks):
            break
    else:
        return BaselineResult.infeasible(name, f"even one sequence per microbatch does not fit (EP size {d})")
    worst, busy, seen = 0.0, {}, {}
    nodes, nics = cluster.node_of(), cluster.nic_gbs()
    for i in range(0, W, d):
        grp = ranks[i:i + d]
        # groups alike in GPU types and node layout take the same time
        first = {}
        shape = tuple((types[r], first.setdefault(nodes[r], len(first)), nics[r]) for r in grp)
        if shape not in seen:
            seen[shape] = _ep_group_mb_time(cost, cluster, grp, [types[r] for r in grp], d, t)
        tm, b = seen[shape]
        worst = max(worst, tm)
        busy.update({r: b[grp0] for r, grp0 in zip(grp, b)})
    links = Links.for_ranks(cluster, ranks, cost.profiles)
    post = allreduce_time(links, m.non_expert_params() * cost.settings.dtype_bytes)
    if W // d > 1:
        post += allreduce_time(Links.for_ranks(cluster, ranks[::d], cost.profiles),
                               per_rank_experts * m.expert_params() * cost.settings.dtype_bytes)
    post += max(cost.optimizer_time(types[r], m.non_expert_params() + per_rank_experts * m.expert_params())
                for r in ranks)
    step = r_mb * worst + post
    util: dict[str, list[float]] = {}
    for r in ranks:
        util.setdefault(types[r], []).append(r_mb * busy[r] / step)
    return BaselineResult(name, step, global_batch * S / step, {g: sum(v) / len(v) for g, v in util.items()},
                          {"ep_size": d, "microbatches": r_mb, "ranks": W, "tokens_per_microbatch": t,
                           "post_step_s": post})


def simulate_ep_ideal(cost: CostModel, cluster: Cluster, global_batch: int) -> BaselineResult:
    S = cost.settings.seq_len
    W = cluster.world_size
    tput, util, detail = 0.0, {}, {}
    for gpu, n in cluster.counts().items():
        b = global_batch * n // W
        res = simulate_ep(cost, cluster, b, cluster.ranks_of(gpu), f"EP on {gpu}") if b else None
        if res is None or not res.fits:
            detail[gpu] = res.reason if res else "no batch share"
            util[gpu] = 0.0
            continue
        tput += res.tokens_per_s
        util.update(res.utilization)
        detail[gpu] = {"tokens_per_s": res.tokens_per_s, **res.detail}
    if tput == 0:
        return BaselineResult.infeasible("EP (Ideal)", f"no GPU type fits alone: {detail}")
    # a type that cannot train alone adds no throughput: named, as a jump in this baseline comes from it
    detail["excluded_layouts"] = {f"EP on {g} alone": v for g, v in detail.items() if isinstance(v, str)}
    return BaselineResult("EP (Ideal)", global_batch * S / tput, tput, util, detail)


_A2A: dict[tuple, float] = {}


def _a2a(cost: CostModel, cluster: Cluster, ranks: tuple[int, ...], t: float) -> float:
    """One even all-to-all of t tokens per rank among `ranks` (memoized: PP asks it per split)."""
    key = (id(cost), cluster, ranks, t)
    if key not in _A2A:
        if len(_A2A) >= 4096:  # bound the memo; cleared before the insert so `key` survives it
            _A2A.clear()
        n = len(ranks)
        links = Links.for_ranks(cluster, list(ranks), cost.profiles)
        _A2A[key] = rank1_collective_time(links, [t] * n, [1.0 / n] * n,
                                          cost.model.moe_router_topk * cost.token_bytes()) if n > 1 else 0.0
    return _A2A[key]


@dataclass(frozen=True)
class PPStage:
    """One pipeline stage: `gpu`'s ranks run layers [first_layer, end_layer); the first stage also
    holds the embedding, the last the final norm, output layer and loss."""

    gpu: str
    ranks: tuple[int, ...]
    first_layer: int
    end_layer: int
    is_first: bool
    is_last: bool

    @property
    def layers(self) -> int:
        return self.end_layer - self.first_layer

    def stages(self, L: int) -> list[int]:
        """The zebra attention stages this stage runs (L: the head stage, on the last stage)."""
        return list(range(self.first_layer, self.end_layer)) + ([L] if self.is_last else [])


def pp_stage_params(cost: CostModel, st: PPStage) -> float:
    """Non-expert parameters one GPU of a stage holds: its zebra stages' (cost_model.stage_params:
    attention, norms, routers, shared experts, dense layers), the embedding on the first stage,
    the output layer and final norm on the last."""
    pieces = [(s, cost.dense_in_stage[s]) for s in st.stages(cost.num_layers)]
    return cost.pipeline_stage_params(pieces, st.is_first, st.is_last)


def pp_stage_time(cost: CostModel, cluster: Cluster, st: PPStage, t: float) -> tuple[float, float]:
    """(seconds, compute seconds) of one microbatch's forward + backward on a stage, t tokens per
    GPU. Attention pieces are the zebra stages s = first_layer..end_layer-1 (and s = L on the last
    stage), so a PP stage runs exactly the attention work the zebra lists count; per layer the
    stage's EP all-to-alls (dispatch + combine, forward and backward) are not overlapped."""
    m = cost.model
    E, k, L = m.num_experts, m.moe_router_topk, cost.num_layers
    d = ep_size(len(st.ranks), E)
    a2a = _a2a(cost, cluster, st.ranks, t)
    per_expert = d * t * k / E
    comp = comm = 0.0
    stages = st.stages(L)
    for bwd in (False, True):
        comp += sum(cost.stage_time(st.gpu, s, t, bwd) for s in stages)
        comp += st.layers * (E // d) * cost.expert_time(st.gpu, per_expert, bwd)
        comm += st.layers * 2 * a2a
    return comp + comm, comp


def pp_stage_bytes(cost: CostModel, st: PPStage, t: float, in_flight: int) -> float:
    """Peak bytes on one GPU of a stage with `in_flight` microbatches alive (1F1B: stage i of P
    holds min(P - i, r)). Same terms as the zebra memory rule (cost_model): weights + optimizer
    state, checkpointed inputs per layer (MoE and dense: Megatron recomputes per layer) per live
    microbatch, one working set (a whole dense layer's, if larger; a shared expert's), fp32 logits."""
    m, b = cost.model, cost.settings.dtype_bytes
    h, E, k = m.hidden_size, m.num_experts, m.moe_router_topk
    d = ep_size(len(st.ranks), E)
    per_expert = d * t * k / E
    dense = sum(cost.dense_in_stage[s] for s in st.stages(cost.num_layers))
    shared = m.moe_shared_expert_intermediate_size or 0
    act = cost.layer_activation_bytes_per_token()  # one whole layer's activations per token
    need = pp_stage_params(cost, st) * BYTES_PER_PARAM_STATE
    need += st.layers * (E // d) * cost.per_expert_bytes(per_expert, in_flight) + cost.expert_working_bytes(per_expert)
    if cost.settings.activation_checkpointing:
        need += (st.layers + dense + 1) * t * h * b * in_flight + max(t * h * b * 20, t * act if dense else 0.0)
        need += t * shared * b * 4  # a shared expert's SwiGLU intermediates while it runs
    else:
        need += (st.layers + dense) * t * act * in_flight + st.layers * t * 3 * shared * b * in_flight
    if st.is_last:
        need += cost.heads * t * m.vocab_size * 4.0
    return need


def _p2p_time(cost: CostModel, cluster: Cluster, src: tuple[int, ...], dst: tuple[int, ...], mb_tokens: float) -> float:
    """Activations of one microbatch from one stage to the next (the same bytes of gradient flow
    back): each GPU of the smaller side moves its share over the link between the stages."""
    links = Links.for_ranks(cluster, list(src) + list(dst), cost.profiles)
    same_node = len(set(links.node)) == 1
    bw = min(links.intra_gbs) if same_node else min(links.inter_gbs)
    per_gpu = mb_tokens * cost.token_bytes() / min(len(src), len(dst))
    return 2 * (links.latency_s + per_gpu / (bw * 1e9))


def simulate_hetero_pp(cost: CostModel, cluster: Cluster, global_batch: int) -> BaselineResult:
    """Heterogeneity-aware pipeline parallelism (module docstring; planner/HETERO_PP.md): best stage
    order, layer split and microbatch count under the 1F1B step model and memory."""
    name = "Hetero PP"
    m = cost.model
    S, L = cost.settings.seq_len, cost.num_layers  # layers split over stages: MoE layers, each with its zebra stage
    counts = cluster.counts()
    kinds = sorted(counts, key=lambda g: cost.attention_time(g, S, False))
    P = len(kinds)
    if P > L:
        return BaselineResult.infeasible(name, f"{P} GPU types but only {L} layers; one stage per type needs "
                                               f"at least {P} layers")
    # a microbatch gives every GPU of every stage whole sequences (no stage splits a sequence)
    unit = math.lcm(*counts.values())
    if global_batch % unit:
        return BaselineResult.infeasible(name, f"global batch {global_batch} is not a multiple of {unit} (whole "
                                               f"sequences for every GPU of every stage); use a multiple of {unit}")
    orders = list(permutations(kinds)) if P <= 4 else [tuple(kinds)]  # 4! = 24 orders at most
    splits = [tuple(b - a for a, b in zip((0,) + c, c + (L,))) for c in combinations(range(1, L), P - 1)]
    ranks_of = {g: tuple(cluster.ranks_of(g)) for g in kinds}
    best = None
    fits_somewhere: set[str] = set()
    why: dict[str, str] = {}
    times: dict[tuple, tuple[float, float]] = {}
    for order in orders:
        for split in splits:
            bounds = list(zip((0,) + tuple(itertools.accumulate(split))[:-1], itertools.accumulate(split)))
            stages = [PPStage(g, ranks_of[g], a, b, i == 0, i == P - 1)
                      for i, (g, (a, b)) in enumerate(zip(order, bounds))]
            label = " | ".join(f"{st.gpu}: layers {st.first_layer}-{st.end_layer - 1}" for st in stages)
            for r_mb in _divisors(global_batch // unit):
                mb_tokens = global_batch // r_mb * S
                T, comp, bad = [], [], None
                for i, st in enumerate(stages):
                    t = mb_tokens / len(st.ranks)
                    in_flight = min(P - i, r_mb)
                    need = pp_stage_bytes(cost, st, t, in_flight)
                    if need > cost.profile(st.gpu).usable_memory_bytes:
                        bad = (f"{st.gpu} stage needs {need / 2**30:.1f} GiB > "
                               f"{cost.profile(st.gpu).usable_memory_bytes / 2**30:.1f} GiB usable even with "
                               f"{r_mb} microbatches")
                        break
                    key = (st, t)
                    if key not in times:
                        times[key] = pp_stage_time(cost, cluster, st, t)
                    tm, c = times[key]
                    if i + 1 < P:
                        tm += _p2p_time(cost, cluster, st.ranks, stages[i + 1].ranks, mb_tokens)
                    T.append(tm)
                    comp.append(c)
                if bad:
                    why[label] = bad  # r_mb ascending: the last refusal had the smallest microbatches
                    continue
                fits_somewhere.add(label)
                step = sum(T) + (r_mb - 1) * max(T)  # 1F1B: fill/drain once, then the slowest stage per microbatch
                if best is None or step < best[0]:
                    best = (step, r_mb, stages, comp, label, sum(T) - max(T))
    excluded = {k: v for k, v in sorted(why.items()) if k not in fits_somewhere}
    if best is None:
        return BaselineResult.infeasible(name, "no stage order, layer split and microbatch count fits in memory; "
                                               f"e.g. {next(iter(excluded.items()), ('', ''))}")
    step, r_mb, stages, comp, label, bubble = best
    post = 0.0
    for st in stages:  # data-parallel gradient sync inside each stage (stages sync at once), optimizer
        d = ep_size(len(st.ranks), m.num_experts)
        dense = pp_stage_params(cost, st)
        expert = st.layers * (m.num_experts // d) * m.expert_params()
        t = allreduce_time(Links.for_ranks(cluster, list(st.ranks), cost.profiles), dense * cost.settings.dtype_bytes)
        if len(st.ranks) // d > 1:  # each expert's replicas: one per EP group of the stage
            t += allreduce_time(Links.for_ranks(cluster, list(st.ranks[::d]), cost.profiles),
                                expert * cost.settings.dtype_bytes)
        post = max(post, t + cost.optimizer_time(st.gpu, dense + expert))
    step += post
    util = {st.gpu: r_mb * c / step for st, c in zip(stages, comp)}
    return BaselineResult(name, step, global_batch * S / step, util,
                          {"stages": [st.gpu for st in stages], "layers_per_stage": [st.layers for st in stages],
                           "microbatches": r_mb, "sequences_per_microbatch": global_batch // r_mb, "layout": label,
                           "bubble_s": bubble, "post_step_s": post, "excluded_layouts": excluded})


def _per_token_floor(f: Callable[[float], float], top: float, table_tokens: list[float]) -> float:
    """min over 0 < t <= top of f(t) / t, seconds per token. Analytic profiles: f(t)/t falls with t
    (fixed weight traffic and launches amortize), so t = top; measured profiles interpolate rates
    piecewise between table points, so the best rate sits at a table point or an end."""
    grid = {top} | {x for x in table_tokens if 0 < x <= top}
    x = 1.0
    while x < top:
        grid.add(x)
        x *= 2
    return min(f(t) / t for t in grid)


def physical_limit(cost: CostModel, cluster: Cluster, global_batch: int) -> BaselineResult:
    """Compute-only lower bound on any strategy's step (module docstring)."""
    m = cost.model
    S, L, k = cost.settings.seq_len, cost.num_layers, m.moe_router_topk
    counts = cluster.counts()
    top = float(global_batch) * S * k  # no call of any strategy sees more tokens than the whole step's
    a, e = {}, {}
    for g in counts:  # seconds of work per sequence, forward + backward, at the cheapest per-token call size
        meas = cost.profile(g).measured
        att_pts = [float(x.tokens) for x in meas.attention] if meas else []
        exp_pts = [float(x.tokens) for x in meas.expert] if meas else []
        pts = att_pts + exp_pts  # the head's rate comes from the expert table (cost_model.head_time)
        # stages of one kind cost alike (cost_model.stage_kind): one floor per kind of stage
        first: dict[tuple, int] = {}
        for s in range(L + 1):
            first.setdefault(cost.stage_kind(s), s)
        fl = {kind: _per_token_floor(lambda t, s=s: cost.stage_time(g, s, t, False) + cost.stage_time(g, s, t, True),
                                     top, pts) for kind, s in first.items()}
        a[g] = S * sum(fl[cost.stage_kind(s)] for s in range(L + 1))
        e[g] = L * S * k * _per_token_floor(lambda t: cost.expert_time(g, t, False) + cost.expert_time(g, t, True),
                                            top, exp_pts)
    order = sorted(counts, key=lambda g: a[g] / e[g])
    B = float(global_batch)

    def feasible(T: float) -> bool:
        left = B
        spare = 0.0
        for g in order:
            cap = counts[g] * T
            x = min(left, cap / a[g])
            left -= x
            spare += (cap - x * a[g]) / e[g]
        return left <= 1e-9 * B and spare >= B * (1 - 1e-12)

    lo, hi = 0.0, B * max(a[g] + e[g] for g in counts) / min(counts.values())
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return BaselineResult("Physical limit", hi, B * S / hi, {g: 1.0 for g in counts},
                          {"attention_s_per_seq": a, "expert_s_per_seq": e})


# ---------------------------------------------------------------- the network floor and the roofline
NETWORK_FLOOR = "Network + compute floor (layouts)"
ROOFLINE = "Roofline (compute + network)"


def distinct_nodes(num_experts: int, topk: int, holdings: list[int], groups: int | None = None,
                   group_topk: int | None = None) -> float:
    """Expected number of distinct nodes a token's top-k experts sit on, experts routed uniformly
    (the balanced routing the cost model assumes), `holdings[i]` experts on node i: sum over nodes
    of 1 - C(E - c_i, k) / C(E, k). Group-limited routing (`groups`, `group_topk`: the k experts
    lie in group_topk of `groups` groups of consecutive experts) where the nodes hold whole groups
    (contiguous, equal holdings dividing the groups): at most the expected distinct nodes of
    group_topk groups drawn among `groups`, each group counted as reached."""
    def missed(total: int, held: int, draws: int) -> float:  # C(total - held, draws) / C(total, draws)
        q = 1.0
        for j in range(draws):
            q *= max(0.0, (total - held - j) / (total - j))
        return q

    d = sum(1.0 - missed(num_experts, c, topk) for c in holdings if c)
    n = len(holdings)
    if groups and group_topk and len(set(holdings)) == 1 and groups % n == 0:
        c = groups // n
        d = min(d, n * (1.0 - missed(groups, c, group_topk)))
    return d


def network_limit(cost: CostModel, cluster: Cluster, global_batch: int,
                  layouts: list[tuple[list[int], list[int], int, int]], compute: BaselineResult) -> BaselineResult:
    """A lower bound on the step of the disaggregated `layouts` (attention and experts on different
    ranks, HeterMoE's; each (attention ranks, expert ranks, ZP groups G, pipeline stages P), its
    ranks group by group and stage by stage as plans lay them out), from the bytes a step must move
    across NICs and the compute each role must do. Bytes, with per-node dedup: a routed token goes
    once to each distinct node holding one of its experts (distinct_nodes) in each of a MoE layer's
    four transfers, two per direction (dispatch forward and the combine's gradient toward the
    experts; the combine forward and the dispatch's gradient back; three toward the experts with
    expert recompute 'resend-inputs'). Per layout:
      * a layer's experts split evenly over its stage's expert ranks (N = expert ranks / (G P)),
        so over their nodes;
      * a fraction f of the routed work may run on the attention ranks (Asym-EA), at most an
        attention node's memory over one stage's copy of the experts' weights and state (the
        distributed optimizer's least, state sharded over every rank); those tokens may stay
        on their node;
      * network(f) = (1 - f) x tokens x MoE layers x distinct nodes x token bytes per direction
        through the layout's attention NICs or its expert NICs, the fewer;
      * attention(f) = global batch x (a + f e) / attention ranks and experts(f) = global batch x
        (1 - f) / sum(ranks / e) over the expert ranks' types, with a and e the compute-only
        limit's seconds per sequence of attention and expert work at each type's best per-token
        rate (physical_limit);
      * the layout's floor: the least over f of the largest of the three.
    The floor is the least over the layouts (the search passes every layout a strategy fits in);
    the roofline is it or the compute-only limit, the larger. It ignores latency and overlap, so no
    plan of those layouts beats it (the simulator prices top-k copies, no dedup: the plugin's
    transport does not dedup per node); Megatron EP, which places experts with its tokens'
    attention, is not bound by it."""
    m = cost.model
    S, L, E, k = cost.settings.seq_len, cost.num_layers, m.num_experts, m.moe_router_topk
    types, nodes, nics = cluster.gpu_types(), cluster.node_of(), cluster.nic_gbs()
    a_s, e_s = compute.detail["attention_s_per_seq"], compute.detail["expert_s_per_seq"]
    tokens, B = float(global_batch) * S, float(global_batch)
    toward = 3 if cost.settings.expert_recompute == "resend-inputs" else 2
    copy = L * E * m.expert_params() * cost.state_bytes_per_param(cluster.world_size)
    node_memory: dict[int, float] = {}
    for r, g in enumerate(types):
        node_memory[nodes[r]] = node_memory.get(nodes[r], 0.0) + cost.profile(g).usable_memory_bytes
    best, detail, seen = math.inf, {}, set()
    for attn, expert, G, P in layouts:
        N = len(expert) // (G * P)
        key = (tuple(attn), tuple(expert), G, P)
        if key in seen or not N:
            continue
        seen.add(key)
        held: dict[int, int] = {}
        for i, r in enumerate(expert[:N]):  # group 0, stage 0: every stage of every group alike
            held[nodes[r]] = held.get(nodes[r], 0) + E // N + (1 if i < E % N else 0)
        d = distinct_nodes(E, k, list(held.values()), m.moe_router_num_groups, m.moe_router_group_topk)
        f_max = min(1.0, max(node_memory[nodes[r]] for r in attn) * P / copy)
        net0 = toward * tokens * L * d * cost.token_bytes() / (
            min(sum(nics[r] for r in attn), sum(nics[r] for r in expert)) * 1e9)
        g_a = types[attn[0]]  # a role split puts one GPU type on the attention side
        att0, att1 = B * a_s[g_a] / len(attn), B * e_s[g_a] / len(attn)  # attention(f) = att0 + f att1
        exp0 = B / sum(1.0 / e_s[types[r]] for r in expert)  # experts(f) = (1 - f) exp0
        # the largest of three lines in f is least where the rising one meets a falling one, or at an end
        fs = {0.0, f_max} | {f for f in ((exp0 - att0) / (att1 + exp0), (net0 - att0) / (att1 + net0))
                             if 0.0 < f < f_max}
        t, f = min((max(att0 + f * att1, (1 - f) * exp0, (1 - f) * net0), f) for f in fs)
        if t < best:
            best = t
            detail = {"groups": G, "pipeline_stages": P, "attention_gpu": g_a, "expert_nodes_per_stage": len(held),
                      "distinct_nodes_per_token": d, "routed_on_attention": f, "network_s": (1 - f) * net0,
                      "attention_s": att0 + f * att1, "experts_s": (1 - f) * exp0}
    if not math.isfinite(best):
        return BaselineResult(NETWORK_FLOOR, 0.0, 0.0, {}, {"why": "no disaggregated layout fits: no floor"})
    return BaselineResult(NETWORK_FLOOR, best, tokens / best, {}, detail)


def roofline(compute: BaselineResult, network: BaselineResult) -> BaselineResult:
    """The larger of the compute-only limit and the layouts' floor of network and compute
    (network_limit): what a disaggregated layout can reach at best (compute and transfers overlap
    at most fully). bound_by: "compute" where the compute-only limit is the larger, else the term
    that binds the best layout's floor (network, attention or experts)."""
    step = max(compute.step_time_s, network.step_time_s)
    binds = "compute"
    if network.step_time_s > compute.step_time_s:
        d = network.detail
        binds = max(("network", d["network_s"]), ("attention ranks", d["attention_s"]),
                    ("expert ranks", d["experts_s"]), key=lambda x: x[1])[0]
    return BaselineResult(ROOFLINE, step, compute.tokens_per_s * compute.step_time_s / step, {},
                          {"bound_by": binds, "compute_s": compute.step_time_s, "layouts_floor_s": network.step_time_s})


# ---------------------------------------------------------------- Megatron EP with TP and PP
MEGATRON_TP = (1, 2, 4, 8)  # TP sizes the Megatron EP baseline tries (inside a node)
MEGATRON_PP = (1, 2, 4, 8)  # PP sizes it tries (dividing the MoE layers)


def _megatron_group_mb_time(cost: CostModel, cluster: Cluster, ranks: list[int], gpus: list[str], d: int, t: float,
                            stages: list[int], layers: int, tp: int) -> tuple[float, dict[int, float]]:
    """Forward+backward of one microbatch through one EP group of a pipeline stage: the zebra
    attention `stages` it runs (TP-priced: cost.stage_time with tp) and `layers` MoE layers, each
    bulk-synchronous (slowest member, then the two all-to-alls); t tokens per rank (its sequence
    slice). Also each rank's busy compute time."""
    m = cost.model
    E, k = m.num_experts, m.moe_router_topk
    a2a = _a2a(cost, cluster, tuple(ranks), t) if len(ranks) > 1 else 0.0
    per_expert = d * t * k / E
    kinds = sorted(set(gpus))  # ranks of one type cost alike
    busy = {g: 0.0 for g in kinds}
    total = 0.0
    for bwd in (False, True):
        for s in stages:
            st = {g: cost.stage_time(g, s, t, bwd, tp) for g in kinds}
            total += max(st.values())
            for g, x in st.items():
                busy[g] += x
        et = {g: (E // d) * cost.expert_time(g, per_expert, bwd) for g in kinds}
        total += layers * (max(et.values()) + 2 * a2a)
        for g, x in et.items():
            busy[g] += layers * x
    return total, {r: busy[g] for r, g in zip(ranks, gpus)}


def megatron_stage_bytes(cost: CostModel, st: PPStage, t: float, in_flight: int, tp: int, d: int,
                         dp_dense: int, dp_expert: int, pp: int) -> float:
    """Peak bytes on one rank of a Megatron stage (TP tp with sequence parallelism, EP d, PP pp):
    its dense parameters (pp_stage_params split tp ways, norms and routers whole) and its E/d
    experts of each of its layers with their state (distributed optimizer: over dp_dense /
    dp_expert replicas) and routed tokens of `in_flight` microbatches, its layers' checkpointed
    inputs (Megatron's per-layer full recompute; t is the rank's sequence slice) and one working
    set (with the all-gathered sequence under TP), fp32 logits of its vocabulary shard on the
    last stage. pp 1 is cost.attention_rank_bytes(layer_checkpoints=True)'s rule."""
    m, b = cost.model, cost.settings.dtype_bytes
    h, E, k = m.hidden_size, m.num_experts, m.moe_router_topk
    per_expert = d * t * k / E
    experts = st.layers * (E // d) * cost.per_expert_bytes(per_expert, in_flight, dp_expert) \
        + cost.expert_working_bytes(per_expert)
    if pp == 1:
        return cost.attention_rank_bytes(t, in_flight, layer_checkpoints=True, tp=tp, dp=dp_dense) + experts
    stages = st.stages(cost.num_layers)
    rep = cost.tp_replicated_params(stages)
    dense_params = (pp_stage_params(cost, st) - rep) / tp + rep
    need = dense_params * cost.state_bytes_per_param(dp_dense) + experts
    dense = sum(cost.dense_in_stage[s] for s in stages)
    shared = m.moe_shared_expert_intermediate_size or 0
    act = cost.layer_activation_bytes_per_token()  # one whole layer's activations per token
    if cost.settings.activation_checkpointing:
        need += (st.layers + dense + 1) * t * h * b * in_flight + max(t * h * b * 20, t * act if dense else 0.0)
        need += t * shared * b * 4
    else:
        need += (st.layers + dense) * t * act * in_flight + st.layers * t * 3 * shared * b * in_flight
    need += (tp - 1) * t * h * b if tp > 1 else 0.0
    if st.is_last:
        need += cost.heads * t * m.vocab_size * 4.0
    return need


def megatron_ep_config_reason(cost: CostModel, cluster: Cluster, ranks: list[int], tp: int, pp: int) -> str:
    """Why Megatron cannot run TP tp x PP pp over `ranks` ('' if it can)."""
    m = cost.model
    W, S, L = len(ranks), cost.settings.seq_len, cost.model.num_moe_layers  # the MTP layers go to the last stage
    if W % (tp * pp):
        return f"{W} ranks are not a multiple of TP {tp} x PP {pp}"
    if m.num_attention_heads % tp or S % tp:
        return f"TP {tp} does not divide the {m.num_attention_heads} heads and the sequence length {S}"
    if L % pp:
        return f"PP {pp} does not divide the {L} MoE layers"
    nodes = cluster.node_of()
    if any(len({nodes[r] for r in ranks[i:i + tp]}) > 1 for i in range(0, W, tp)):
        return f"TP {tp} groups would span nodes"
    return ""


def simulate_megatron_ep(cost: CostModel, cluster: Cluster, global_batch: int, ranks: list[int] | None = None,
                         tp: int = 1, pp: int = 1, name: str = "Megatron EP") -> BaselineResult:
    """Megatron EP with tensor parallelism tp (sequence parallel, expert TP 1) and pipeline
    parallelism pp over `ranks` (default: all), in Megatron's rank order (TP innermost, then
    DP/EP, PP outermost: stage i is the i-th block of W/pp ranks, an even split of the layers).
    Inside a stage the dense weights' data-parallel size is W/(pp tp), EP size d = the largest
    divisor of W/pp and E (ep_size), each TP rank dispatching its own slice. Every microbatch
    count r dividing the sequences per data-parallel member is tried (pp 1: the fewest that fit,
    as simulate_ep); step = 1F1B's
    sum_i T_i + (r-1) max_i T_i (T_i: forward+backward of one microbatch on stage i, its EP
    all-to-alls, TP collectives and the P2P send to the next stage, none overlapped; pp 1:
    r T), + gradient all-reduce and optimizer."""
    m = cost.model
    S, L, E = cost.settings.seq_len, cost.num_layers, m.num_experts
    types = cluster.gpu_types()
    ranks = list(range(cluster.world_size)) if ranks is None else list(ranks)
    why = megatron_ep_config_reason(cost, cluster, ranks, tp, pp)
    if why:
        return BaselineResult.infeasible(name, why)
    W = len(ranks)
    Ws = W // pp
    dp = Ws // tp
    d = ep_size(Ws, E)
    if global_batch % dp:
        return BaselineResult.infeasible(name, f"global batch {global_batch} is not a multiple of the {dp} data-"
                                               f"parallel members (TP {tp}, PP {pp})")
    spm = global_batch // dp
    per = m.num_moe_layers // pp  # the decoder's MoE layers split evenly; MTP layers on the last stage (Megatron's)
    stages = [PPStage(types[ranks[i * Ws]], tuple(ranks[i * Ws:(i + 1) * Ws]), i * per,
                      L if i == pp - 1 else (i + 1) * per, i == 0, i == pp - 1) for i in range(pp)]
    nodes, nics = cluster.node_of(), cluster.nic_gbs()
    best, last_bad = None, ""
    for r_mb in _divisors(spm):
        t = spm // r_mb * S / tp  # tokens per rank per microbatch: its sequence slice
        bad = ""
        for i, st in enumerate(stages):
            need = megatron_stage_bytes(cost, st, t, min(pp - i, r_mb), tp, d, dp, Ws // d, pp)
            worst_mem = min(cost.profile(types[r]).usable_memory_bytes for r in st.ranks)
            if need > worst_mem:
                bad = (f"stage {i} needs {need / 2**30:.1f} GiB > {worst_mem / 2**30:.1f} GiB usable with "
                       f"{r_mb} microbatch(es) (TP {tp}, PP {pp}, EP {d})")
                break
        if bad:
            last_bad = bad
            continue
        T, busy = [], {}
        for i, st in enumerate(stages):
            seen: dict[tuple, tuple] = {}
            worst = 0.0
            for j in range(0, Ws, d):
                grp = list(st.ranks[j:j + d])
                first: dict[int, int] = {}
                shape = tuple((types[r], first.setdefault(nodes[r], len(first)), nics[r]) for r in grp)
                if shape not in seen:
                    seen[shape] = _megatron_group_mb_time(cost, cluster, grp, [types[r] for r in grp], d, t,
                                                          st.stages(L), st.layers, tp)
                tm, b = seen[shape]
                worst = max(worst, tm)
                busy.update({r: b[g0] for r, g0 in zip(grp, b)})
            if i + 1 < pp:
                worst += _p2p_time(cost, cluster, st.ranks, stages[i + 1].ranks, global_batch // r_mb * S)
            T.append(worst)
        step = sum(T) + (r_mb - 1) * max(T)
        if best is None or step < best[0]:
            best = (step, r_mb, T, busy, t)
        if pp == 1:
            break  # no pipeline: the fewest microbatches that fit are the fastest (as simulate_ep)
    if best is None:
        return BaselineResult.infeasible(name, f"no microbatch count fits: {last_bad}")
    step, r_mb, T, busy, t = best
    post = 0.0
    gb = cost.settings.dtype_bytes
    for st in stages:
        rep = cost.tp_replicated_params(st.stages(L))
        dense = (pp_stage_params(cost, st) - rep) / tp + rep
        expert = st.layers * (E // d) * m.expert_params()
        tm = 0.0
        for pos in range(tp):  # the TP ranks' data-parallel groups all-reduce at once
            tm = max(tm, allreduce_time(Links.for_ranks(cluster, list(st.ranks[pos::tp]), cost.profiles), dense * gb))
        if Ws // d > 1:
            tm += allreduce_time(Links.for_ranks(cluster, list(st.ranks[::d]), cost.profiles), expert * gb)
        tm += max(cost.optimizer_time(types[r], dense + expert) for r in st.ranks)
        post = max(post, tm)
    step += post
    util: dict[str, list[float]] = {}
    for r in ranks:
        util.setdefault(types[r], []).append(r_mb * busy[r] / step)
    return BaselineResult(name, step, global_batch * S / step, {g: sum(v) / len(v) for g, v in util.items()},
                          {"tp": tp, "pp": pp, "ep_size": d, "microbatches": r_mb, "ranks": W,
                           "tokens_per_microbatch": t, "bubble_s": sum(T) - max(T) if pp > 1 else 0.0,
                           "post_step_s": post})


def best_megatron_ep(cost: CostModel, cluster: Cluster, global_batch: int, ranks: list[int] | None = None,
                     name: str = "Megatron EP (best TP/PP)") -> BaselineResult:
    """The fastest simulate_megatron_ep over TP in MEGATRON_TP and PP in MEGATRON_PP (each with
    its best microbatch count); detail["excluded_layouts"] names every configuration that could
    not run and why."""
    best, why = None, {}
    for tp in MEGATRON_TP:
        for pp in MEGATRON_PP:
            res = simulate_megatron_ep(cost, cluster, global_batch, ranks, tp, pp, name)
            if not res.fits:
                why[f"TP {tp} x PP {pp}"] = res.reason
            elif best is None or res.step_time_s < best.step_time_s:
                best = res
    if best is None:
        return BaselineResult.infeasible(name, "no TP/PP configuration fits: " +
                                         "; ".join(f"{k}: {v}" for k, v in why.items()))
    best.detail["excluded_layouts"] = {k: v for k, v in why.items() if "does not divide" not in v
                                       and "not a multiple" not in v and "span nodes" not in v}
    return best


def newest_gpu(cost: CostModel, cluster: Cluster) -> str:
    """The cluster's fastest GPU type (largest dense fp16 peak): the "new GPUs" of a mixed cluster."""
    return max(cluster.counts(), key=lambda g: cost.profile(g).peak_fp16_tflops)
