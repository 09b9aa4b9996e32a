"""Asymmetric expert assignment (Asym-EA): how many whole experts of each layer move from the
expert ranks to the attention ranks of a ZP group, and which rank holds which expert.

Two solvers over the same problem (`AsymProblem`), both returning k[l] = number of experts of
layer l held on the attention side of a group:

* `gather_squeeze` - the paper's Algorithm 1 (PAPER.md), forward times only. Chunks of
  n1 = max(1, N/M) experts per attention rank (n2 = n1*M/N given up per expert rank), so it
  needs M | N or N | M. T_squeeze is the idle time one chunk removes, n2 t_exp + n1 t_x: the
  expert side loses n2 experts' work and the attention side gains n1, so the gap T_gather
  measures closes by both. PAPER.md's gloss "time saved on the expert GPU minus time added on
  the attention GPU" (n2 t_exp - n1 t_x) is the saving of a serial layer, not idle removed; taken
  literally it is small when both GPU types run experts at similar speed and the walk moves every
  expert of every layer (D1 on O1, one 6:6 group, R=8: 24 of 24 per layer at 4K and 8K, 1.58x
  and 1.54x slower simulated steps than the optimal assignment, slower than no Asym-EA at all;
  with the idle it removes: 0.99x and 0.96x). Where the paper is silent we chose: the accumulated idle time is
  clamped at 0 (an expert side that runs ahead cannot bank time: a Lindley recursion), a layer
  gives at most all its experts, and the memory limits scale the accumulation by alpha <= 1
  (largest scale with n1 * sum(chunks) <= n_max) or beta >= 1 (smallest scale with
  n2 * sum(chunks) >= n_min), found by bisection; if no scale makes chunks (nothing to gather)
  while n_min > 0, the required chunks go to the last layers, one per layer, round robin.

* `optimal` - any M:N. Per layer, the attention ranks hold a = ceil(k/M) experts at most and the
  expert ranks q = ceil((E-k)/N). The objective is the per-layer bottleneck of the two roles
  over forward+backward (the zebra list makes attention of layer l+1 wait for all of layer l's
  offloaded experts, so idle time does not carry across layers; the simulator agrees much
  better with this than with max(sum P, sum Q), see tests):
        J(k) = sum_l max(P_l, Q_l),  P_l = t_attn_l + a_l t_x,  Q_l = q_l t_e,
  under memory: sum_l a_l <= n_max (what an attention rank can hold) and sum_l q_l <= cap_x
  (what an expert rank can hold). A DP over layers with state (sum a, sum q) is exactly optimal
  for J (tests check it against brute force). Where layers are alike the offload goes to the
  first layers (J does not see the order; the simulator prefers it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_hetermoe.plan.hetero_plan import PlanError


@dataclass(frozen=True)
class AsymProblem:
    num_layers: int
    num_experts: int
    M: int  # attention ranks per group
    N: int  # expert ranks per group
    # per MoE layer l: attention stage l (attention, router, shared expert and any dense layers run
    # before it; cost_model.stage_time), one microbatch, attention GPU
    t_attn: tuple[float, ...]
    t_exp: float  # one expert, one microbatch, on an expert GPU
    t_exp_on_attn: float  # the same expert work on an attention GPU
    n_max: int  # experts (summed over layers) one attention rank can hold
    cap_x: int  # experts (summed over layers) one expert rank can hold
    t_attn_extra: float = 0.0  # attention work not followed by an expert layer (output head stage)

    def __post_init__(self) -> None:
        if len(self.t_attn) != self.num_layers:
            raise ValueError(f"t_attn has {len(self.t_attn)} entries for {self.num_layers} layers")
        if self.M < 1 or self.N < 1 or self.num_experts < 1:
            raise ValueError(f"need M, N, num_experts >= 1; got {self.M}, {self.N}, {self.num_experts}")

    @property
    def n_min(self) -> int:
        """Experts (summed over layers) each expert rank must give up to fit in memory."""
        return max(0, self.num_layers * math.ceil(self.num_experts / self.N) - self.cap_x)


# ---------------------------------------------------------------- evaluation
def attention_max(k: int, M: int) -> int:
    return -(-k // M)


def expert_max(k: int, E: int, N: int) -> int:
    return -(-(E - k) // N)


def layer_loads(prob: AsymProblem, k: list[int]) -> list[tuple[float, float]]:
    """(P_l, Q_l) per layer: busiest attention rank's and busiest expert rank's work."""
    return [(prob.t_attn[l] + attention_max(x, prob.M) * prob.t_exp_on_attn,
             expert_max(x, prob.num_experts, prob.N) * prob.t_exp) for l, x in enumerate(k)]


def objective(prob: AsymProblem, k: list[int]) -> float:
    """J(k) = sum_l max(P_l, Q_l) + head stage: the per-layer bottleneck model both solvers are
    scored by."""
    return sum(max(p, q) for p, q in layer_loads(prob, k)) + prob.t_attn_extra


def memory_ok(prob: AsymProblem, k: list[int]) -> bool:
    a = sum(attention_max(x, prob.M) for x in k)
    q = sum(expert_max(x, prob.num_experts, prob.N) for x in k)
    return a <= prob.n_max and q <= prob.cap_x


def _validate_k(prob: AsymProblem, k: list[int], who: str) -> list[int]:
    if not memory_ok(prob, k):
        a = sum(attention_max(x, prob.M) for x in k)
        q = sum(expert_max(x, prob.num_experts, prob.N) for x in k)
        raise PlanError(f"{who}: no expert assignment fits in memory (attention rank would hold {a} > "
                        f"n_max={prob.n_max} experts or expert rank {q} > cap={prob.cap_x}); use more "
                        f"microbatches, more ZP groups, or GPUs with more memory")
    return k


# ---------------------------------------------------------------- Algorithm 1
def gather_squeeze(prob: AsymProblem) -> list[int]:
    """The paper's greedy Algorithm 1 with its alpha/beta memory scaling; returns k[l]."""
    M, N, E, L = prob.M, prob.N, prob.num_experts, prob.num_layers
    if N % M and M % N:
        raise PlanError(f"Algorithm 1 needs M | N or N | M, got M={M}, N={N}; use the optimal assignment "
                        f"(asym='optimal'), which takes any M:N")
    n1 = max(1, N // M)  # experts each attention rank takes per chunk
    n2 = n1 * M // N  # experts each expert rank gives up per chunk
    per_chunk = n1 * M  # experts of the layer moved per chunk
    c_max = E // per_chunk
    t_exp_layer = math.ceil(E / N) * prob.t_exp
    squeeze = n2 * prob.t_exp + n1 * prob.t_exp_on_attn  # idle one chunk removes (module docstring)
    gather = [t_exp_layer - t for t in prob.t_attn]

    def run(scale: float) -> list[int]:
        acc, chunks = 0.0, []
        for g in gather:
            acc = max(0.0, acc + scale * g)
            c = min(c_max, int(acc // squeeze)) if squeeze > 0 and acc >= squeeze else 0
            acc -= c * squeeze
            chunks.append(c)
        return chunks

    chunks = run(1.0)
    if n1 * sum(chunks) > prob.n_max:  # alpha: cap the accumulation
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if n1 * sum(run(mid)) <= prob.n_max else (lo, mid)
        chunks = run(lo)
    if n2 * sum(chunks) < prob.n_min:  # beta: floor the accumulation
        hi = 1.0
        while n2 * sum(run(hi)) < prob.n_min and hi < 1e12:
            hi *= 2
        if n2 * sum(run(hi)) >= prob.n_min:
            lo = hi / 2
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if n2 * sum(run(mid)) >= prob.n_min else (mid, hi)
            chunks = run(hi)
        else:  # nothing to gather: spread the forced chunks over the last layers
            need = -(-prob.n_min // n2) if n2 else 0
            chunks = [0] * L
            i = L - 1
            while need > 0 and any(c < c_max for c in chunks):
                if chunks[i] < c_max:
                    chunks[i] += 1
                    need -= 1
                i = (i - 1) % L
    return _validate_k(prob, [c * per_chunk for c in chunks], "Algorithm 1")


# ---------------------------------------------------------------- optimal
def _options(prob: AsymProblem) -> list[tuple[int, int, int]]:
    """Pareto options (a, q, k) for one layer: fewest attention-side experts for each q."""
    E, M, N = prob.num_experts, prob.M, prob.N
    best: dict[int, tuple[int, int]] = {}
    for a in range(0, attention_max(E, M) + 1):
        k = min(E, a * M)
        q = expert_max(k, E, N)
        k_min = max(0, E - q * N)  # fewest experts moved that still leaves q per expert rank
        a_min = attention_max(k_min, M)
        if q not in best or a_min < best[q][0]:
            best[q] = (a_min, k_min)
    return sorted((a, q, k) for q, (a, k) in best.items())


def optimal(prob: AsymProblem) -> list[int]:
    """Exact minimizer of J(k) within memory, any M:N; returns k[l] (offloading layers first).

    DP over layers; state (u, v) = experts held so far by one attention rank / one expert rank
    (both bounded by memory), value = least sum of per-layer bottlenecks."""
    L = prob.num_layers
    opts = _options(prob)
    U = min(prob.n_max, L * max(o[0] for o in opts))
    V = min(prob.cap_x, L * max(o[1] for o in opts))
    if U < 0:
        raise PlanError(f"attention ranks cannot hold the model without experts (n_max={prob.n_max}); "
                        f"use more microbatches, more ZP groups, or GPUs with more memory")
    if V < L * min(o[1] for o in opts):
        raise PlanError(f"expert ranks can hold {prob.cap_x} experts in all but even the most offloaded "
                        f"assignment leaves {L * min(o[1] for o in opts)} on each; use more expert GPUs, "
                        f"more microbatches, or GPUs with more memory")
    INF = float("inf")
    # when expert memory cannot bind (every assignment fits), v need not be tracked
    track_v = V < L * max(o[1] for o in opts)
    if track_v and L * len(opts) * (U + 1) * (V + 1) > DP_BUDGET:
        return _validate_k(prob, _front_load(prob, _lagrangian(prob, opts, U, V)), "optimal assignment (Lagrangian)")
    Vd = V if track_v else 0
    f = np.full((U + 1, Vd + 1), INF)
    f[0, 0] = 0.0
    choice = np.full((L, U + 1, Vd + 1), -1, dtype=np.int32)
    for l in range(L):
        g = np.full_like(f, INF)
        for oi, (a, q, _) in enumerate(opts):
            dq = q if track_v else 0
            if a > U or dq > Vd:
                continue
            c = max(prob.t_attn[l] + a * prob.t_exp_on_attn, q * prob.t_exp)
            cand = f[:U + 1 - a, :Vd + 1 - dq] + c
            tgt = g[a:, dq:]
            better = cand < tgt
            tgt[better] = cand[better]
            choice[l, a:, dq:][better] = oi
        f = g
    u, v = np.unravel_index(int(np.argmin(f)), f.shape)
    if not np.isfinite(f[u, v]):
        raise PlanError(f"no expert assignment fits: expert ranks can hold {prob.cap_x} experts and attention "
                        f"ranks {prob.n_max} in all, {prob.num_layers} layers x {prob.num_experts} experts needed; "
                        f"use more microbatches, more ZP groups, or GPUs with more memory")
    picked = []
    for l in reversed(range(L)):
        o = opts[int(choice[l, u, v])]
        picked.append((l, o))
        u, v = u - o[0], v - (o[1] if track_v else 0)
    k = [0] * L
    for l, o in picked:
        k[l] = o[2]
    # J ignores layer order; the simulator finds offloading earlier layers drains better
    # (checked in tests), so move offload to the front where layers are alike
    return _validate_k(prob, _front_load(prob, k), "optimal assignment")


DP_BUDGET = 4e7  # element operations of the exact 2-D DP before falling back to the Lagrangian


def _dp_u(prob: AsymProblem, opts: list[tuple[int, int, int]], U: int, lam: float) -> tuple[list[int], int]:
    """1-D DP over u = sum a with cost J + lam * sum q; returns (option index per layer, sum q)."""
    L = prob.num_layers
    INF = float("inf")
    a = np.array([o[0] for o in opts])
    q = np.array([o[1] for o in opts], dtype=float)
    src = np.arange(U + 1)[None, :] - a[:, None]
    valid = src >= 0
    src = np.where(valid, src, 0)
    f = np.full(U + 1, INF)
    f[0] = 0.0
    choice = np.zeros((L, U + 1), dtype=np.int32)
    cols = np.arange(U + 1)
    for l in range(L):
        c = np.maximum(prob.t_attn[l] + a * prob.t_exp_on_attn, q * prob.t_exp) + lam * q
        cand = np.where(valid, f[src] + c[:, None], INF)
        choice[l] = np.argmin(cand, axis=0)
        f = cand[choice[l], cols]
    u = int(np.argmin(f))
    picks = []
    for l in reversed(range(L)):
        o = int(choice[l, u])
        picks.append(o)
        u -= opts[o][0]
    picks.reverse()
    return picks, sum(opts[o][1] for o in picks)


def _lagrangian(prob: AsymProblem, opts: list[tuple[int, int, int]], U: int, V: int) -> list[int]:
    """Large instances: price expert memory (lam per expert held) and bisect on the price for the
    cheapest assignment that fits. Exact when there is no duality gap; marked in the plan's meta."""
    picks, v = _dp_u(prob, opts, U, 0.0)
    if v > V:
        # a price above any possible saving of J makes the DP minimise sum q alone
        worst = sum(max(t + a * prob.t_exp_on_attn, q * prob.t_exp)
                    for t in prob.t_attn for a, q, _ in opts[-1:] + opts[:1])
        if _dp_u(prob, opts, U, 2 * worst + 1.0)[1] > V:
            raise PlanError(f"no expert assignment fits: expert ranks can hold {prob.cap_x} experts and attention "
                            f"ranks {prob.n_max} in all; use more microbatches, more ZP groups, "
                            f"or GPUs with more memory")
        lo, hi = 0.0, max(prob.t_exp, prob.t_exp_on_attn, 1e-9)
        while _dp_u(prob, opts, U, hi)[1] > V and hi < 1e9:
            hi *= 2
        best = _dp_u(prob, opts, U, hi)
        for _ in range(16):  # price resolution 2^-16 of the bracket
            mid = (lo + hi) / 2
            res = _dp_u(prob, opts, U, mid)
            if res[1] > V:
                lo = mid
            else:
                hi, best = mid, res
                if res[1] == V:  # the memory is used exactly: no cheaper price fits
                    break
        picks, v = best
    return [opts[o][2] for o in picks]


def _front_load(prob: AsymProblem, k: list[int]) -> list[int]:
    """Reorder k over layers with equal attention time so that larger offloads come first;
    J is unchanged because equal layers contribute the same per-layer bottleneck."""
    out = list(k)
    by_time: dict[float, list[int]] = {}
    for l, t in enumerate(prob.t_attn):
        by_time.setdefault(round(t, 15), []).append(l)
    for layers in by_time.values():
        vals = sorted((k[l] for l in layers), reverse=True)
        for l, v in zip(layers, vals):
            out[l] = v
    return out


# ---------------------------------------------------------------- placement
def _split_rotating(ids: list[int], holders: list[int], start: int) -> tuple[dict[int, list[int]], int]:
    """Contiguous split of ids over holders, the `len(ids) % len(holders)` extra ones going to the
    holders from `start` on (so extras rotate across layers and per-rank totals stay balanced)."""
    n, h = len(ids), len(holders)
    base, extra = divmod(n, h)
    sizes = [base] * h
    for i in range(extra):
        sizes[(start + i) % h] += 1
    out, pos = {}, 0
    for r, s in zip(holders, sizes):
        if s:
            out[r] = ids[pos:pos + s]
        pos += s
    return out, (start + extra) % h


def placement(k: list[int], num_experts: int, attention_ranks: list[int],
              expert_ranks: list[int]) -> list[dict[int, list[int]]]:
    """placement[l] = {rank: expert ids}: experts 0..E-k_l-1 on the expert ranks, the last k_l on the
    attention ranks, each side as even as possible with the remainders rotating over layers."""
    out = []
    sa = sx = 0
    for kl in k:
        pl: dict[int, list[int]] = {}
        keep = list(range(num_experts - kl))
        moved = list(range(num_experts - kl, num_experts))
        if keep:
            d, sx = _split_rotating(keep, expert_ranks, sx)
            pl.update(d)
        if moved:
            d, sa = _split_rotating(moved, attention_ranks, sa)
            pl.update(d)
        out.append(pl)
    return out
