"""Step-time models of the strategies HeterMoE is compared with (PAPER.md), on the same cost
model and transfer model as the zebra simulator:

* EP over all GPUs (Megatron alltoall): every rank holds the non-expert model and E/d experts
  of every layer (d = expert-parallel size), data split evenly over all ranks; the all-to-alls
  make each layer bulk-synchronous inside an EP group, so per layer the slowest member bounds.
* EP (Ideal): each GPU type trained alone with the same per-GPU batch; throughputs added.
* Heterogeneity-aware PP: one pipeline stage per GPU type (fastest attention first), each
  stage's GPUs share a microbatch (data + expert parallel inside the stage), layers split across
  stages to minimise the 1F1B step (the integer split closest to "proportional to speed"):
  step = sum_t T_t + (r-1) max_t T_t. An idealisation: real PP needs equal DP per stage.
* Physical limit: compute only; attention and expert work of the step split fractionally over
  GPU types to minimise the makespan (an LP; for two kinds of work the optimum gives attention to
  the types with the smallest attention/expert time ratio first), every GPU busy all step.
Each returns a BaselineResult, or one with `fits=False` and the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

from .cluster import Cluster, Links, allreduce_time, rank1_collective_time
from .cost_model import BYTES_PER_PARAM_STATE, CostModel


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


def _ep_group_mb_time(cost: CostModel, cluster: Cluster, ranks: list[int], gpus: list[str], d: int, t: float) -> tuple[float, dict[int, float]]:
    """Forward+backward of one microbatch of t tokens per rank through an EP group (bulk
    synchronous per layer); also each rank's busy compute time."""
    m = cost.model
    L, E, k = m.num_layers, m.num_experts, m.moe_router_topk
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
    per_rank_experts = m.num_layers * (m.num_experts // d)
    for r_mb in _divisors(spr):  # fewest microbatches that fit
        t = spr // r_mb * S
        per_expert_tokens = d * t * m.moe_router_topk / m.num_experts
        need = (cost.attention_rank_bytes(t, 1) + per_rank_experts * cost.per_expert_bytes(per_expert_tokens, 1)
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
    post += max(cost.optimizer_time(types[r], m.non_expert_params() + per_rank_experts * m.expert_params()) for r in ranks)
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
    return BaselineResult("EP (Ideal)", global_batch * S / tput, tput, util, detail)


_A2A: dict[tuple, float] = {}


def _a2a(cost: CostModel, cluster: Cluster, ranks: tuple[int, ...], t: float) -> float:
    """One even all-to-all of t tokens per rank among `ranks` (memoized: PP asks it per split)."""
    key = (id(cost), cluster, ranks, t)
    if key not in _A2A:
        n = len(ranks)
        links = Links.for_ranks(cluster, list(ranks), cost.profiles)
        _A2A[key] = rank1_collective_time(links, [t] * n, [1.0 / n] * n, cost.model.moe_router_topk * cost.token_bytes()) if n > 1 else 0.0
        if len(_A2A) > 4096:
            _A2A.clear()
    return _A2A[key]


def _stage_time(cost: CostModel, cluster: Cluster, ranks: list[int], gpu: str, layers: range, first: bool,
                last: bool, t: float) -> tuple[float, float]:
    """(fwd+bwd time of one microbatch on a stage, its bytes per GPU) with t tokens per GPU."""
    m = cost.model
    E, k = m.num_experts, m.moe_router_topk
    n = len(ranks)
    d = ep_size(n, E)
    a2a = _a2a(cost, cluster, tuple(ranks), t)
    per_expert = d * t * k / E
    tm = 0.0
    for bwd in (False, True):
        # each layer: attention + router, dispatch, experts, combine
        tm += len(layers) * (cost.attention_time(gpu, t, bwd) + (E // d) * cost.expert_time(gpu, per_expert, bwd) + 2 * a2a)
        if last:
            tm += cost.head_time(gpu, t, bwd)
    return tm, len(layers) * (E // d)


def simulate_hetero_pp(cost: CostModel, cluster: Cluster, global_batch: int) -> BaselineResult:
    m = cost.model
    S, L = cost.settings.seq_len, m.num_layers
    counts = cluster.counts()
    # stage order: best attention speed first
    types = sorted(counts, key=lambda g: cost.attention_time(g, S, False))
    P = len(types)
    if P > L:
        return BaselineResult.infeasible("Hetero PP", f"{P} GPU types but only {L} layers")
    stage_ranks = [cluster.ranks_of(g) for g in types]
    best = None
    splits = [tuple(b - a for a, b in zip((0,) + c, c + (L,))) for c in combinations(range(1, L), P - 1)]
    for r_mb in _divisors(global_batch):
        mb_tokens = global_batch // r_mb * S
        stage_cache: dict[tuple, tuple] = {}
        for split in splits:
            T, ok, start, busy = [], True, 0, []
            for si, (g, n_l) in enumerate(zip(types, split)):
                ranks = stage_ranks[si]
                t = mb_tokens / len(ranks)
                key = (si, n_l)
                if key not in stage_cache:
                    stage_cache[key] = _stage_time(cost, cluster, ranks, g, range(start, start + n_l), si == 0, si == P - 1, t)
                tm, experts = stage_cache[key]
                in_flight = P - si  # 1F1B: stage si holds up to P - si microbatches
                d = ep_size(len(ranks), m.num_experts)
                need = (m.non_expert_params() * n_l / L * BYTES_PER_PARAM_STATE
                        + experts * cost.per_expert_bytes(d * t * m.moe_router_topk / m.num_experts, in_flight)
                        + (n_l + 1) * t * m.hidden_size * cost.settings.dtype_bytes * in_flight
                        + (t * m.vocab_size * 4.0 if si == P - 1 else 0.0))
                if need > cost.profile(g).usable_memory_bytes:
                    ok = False
                    break
                if si + 1 < P:  # activations to the next stage and gradients back
                    nxt = stage_ranks[si + 1]
                    per_gpu = mb_tokens * cost.token_bytes() / min(len(ranks), len(nxt))
                    tm += 2 * per_gpu / (min(cluster.nic_gbs()[ranks[0]], cluster.nic_gbs()[nxt[0]]) * 1e9)
                T.append(tm)
                busy.append(tm)
                start += n_l
            if not ok:
                continue
            step = sum(T) + (r_mb - 1) * max(T)
            if best is None or step < best[0]:
                best = (step, r_mb, split, busy)
    if best is None:
        return BaselineResult.infeasible("Hetero PP", "no layer split and microbatch count fits in memory")
    step, r_mb, split, busy = best
    post = 0.0
    for si, g in enumerate(types):
        ranks = stage_ranks[si]
        params = m.non_expert_params() * split[si] / L + split[si] * m.num_experts * m.expert_params() / ep_size(len(ranks), m.num_experts)
        post = max(post, allreduce_time(Links.for_ranks(cluster, ranks, cost.profiles), params * cost.settings.dtype_bytes)
                   + cost.optimizer_time(g, params))
    step += post
    util = {g: r_mb * busy[si] / step for si, g in enumerate(types)}
    return BaselineResult("Hetero PP", step, global_batch * S / step, util,
                          {"stages": types, "layers_per_stage": list(split), "microbatches": r_mb})


def physical_limit(cost: CostModel, cluster: Cluster, global_batch: int) -> BaselineResult:
    m = cost.model
    S, L, k = cost.settings.seq_len, m.num_layers, m.moe_router_topk
    counts = cluster.counts()
    a, e = {}, {}
    for g in counts:  # seconds of work per sequence, forward + backward
        a[g] = sum(cost.stage_time(g, s, S, False) + cost.stage_time(g, s, S, True) for s in range(L + 1))
        tok = S * k  # a large GEMM: best efficiency
        e[g] = L * (cost.expert_time(g, tok, False) + cost.expert_time(g, tok, True))
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
