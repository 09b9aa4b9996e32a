"""Asym-EA: the paper's Algorithm 1 on hand-checked cases, and the optimal assignment
(exact against brute force, never worse than Algorithm 1, any M:N, within memory)."""
import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, ZPGroup
from megatron_hetermoe.planner import asym_ea
from megatron_hetermoe.planner.asym_ea import AsymProblem


def prob(L=4, E=8, M=2, N=2, t_attn=1.75, t_exp=0.5, t_x=0.125, n_max=10**6, cap_x=10**6):
    return AsymProblem(L, E, M, N, (t_attn,) * L, t_exp, t_x, n_max, cap_x)


# ---- Algorithm 1, by hand ---------------------------------------------------------------
def test_greedy_accumulates_gather_until_a_squeeze():
    # M=N=2: n1=n2=1, a chunk moves 2 experts. T_exp(layer) = 4 * 0.5 = 2, gather = 2 - 1.5 = 0.5,
    # squeeze = idle one chunk removes = 0.5 + 0.125 = 0.625. Running total: .5 | 1 -> 1 chunk,
    # .375 | .875 -> 1, .25 | .75 -> 1, .125
    assert asym_ea.gather_squeeze(prob(t_attn=1.5)) == [0, 2, 2, 2]


def test_greedy_squeeze_counts_both_sides_of_the_gap():
    # One chunk closes the attention ranks' idle by the expert work it takes off an expert rank
    # AND the work it adds to an attention rank: gather 2 - 1.25 = 0.75 = squeeze 0.5 + 0.25, so
    # exactly one chunk per layer balances P and Q (1.25 + 0.25 = 1.5 = 3 * 0.5). Saved minus
    # added (0.25) would take 3 chunks per layer: P = 2, Q = 0.5, the attention side the bottleneck.
    p = prob(t_attn=1.25, t_x=0.25)
    k = asym_ea.gather_squeeze(p)
    assert k == [2, 2, 2, 2]
    assert all(ps == qs for ps, qs in asym_ea.layer_loads(p, k))


def test_greedy_chunks_when_n_is_a_multiple_of_m():
    # M=2, N=4: n1=2 per attention rank, n2=1 per expert rank, 4 experts per chunk.
    # T_exp(layer) = 2 * 0.5 = 1, gather = 0.75, squeeze = 0.5 + 2 * 0.125 = 0.75: a chunk every layer.
    assert asym_ea.gather_squeeze(prob(N=4, t_attn=0.25)) == [4, 4, 4, 4]


def test_greedy_alpha_caps_by_attention_memory():
    # as above, but an attention rank holds at most 4 experts = 2 chunks. The largest scale that
    # fits is alpha in [2/3, 3/4): gather g = 0.75 alpha in [1/2, 9/16); totals g | 2g -> chunk,
    # 2g - 3/4 | 3g - 3/4 -> chunk, 3g - 3/2 | 4g - 3/2 < 3/4 -> none.  (alpha = 3/4 takes 3 chunks.)
    assert asym_ea.gather_squeeze(prob(N=4, t_attn=0.25, n_max=4)) == [0, 4, 4, 0]


def test_greedy_beta_forces_the_experts_that_do_not_fit():
    # attention is slower (nothing to gather), but each expert rank holds 12 of its 16 experts:
    # n_min = 4 chunks must move; with nothing to scale they go one per layer from the last
    p = prob(t_attn=3.0, cap_x=12)
    assert p.n_min == 4
    assert asym_ea.gather_squeeze(p) == [2, 2, 2, 2]


def test_greedy_needs_divisibility_and_says_what_to_use():
    with pytest.raises(PlanError, match=r"M \| N or N \| M.*optimal"):
        asym_ea.gather_squeeze(prob(M=2, N=3))


def test_nothing_fits_is_an_error():
    with pytest.raises(PlanError, match="fit"):
        asym_ea.optimal(prob(n_max=0, cap_x=3))


# ---- optimal ----------------------------------------------------------------------------
def brute_force(p: AsymProblem):
    best = None
    for k in itertools.product(range(p.num_experts + 1), repeat=p.num_layers):
        if asym_ea.memory_ok(p, list(k)):
            j = asym_ea.objective(p, list(k))
            best = j if best is None else min(best, j)
    return best


problems = st.builds(
    lambda L, E, M, N, ta, te, tx, nmax, capx, first: AsymProblem(
        L, E, M, N, (ta * first,) + (ta,) * (L - 1), te, tx, nmax, capx),
    st.integers(1, 3), st.integers(1, 7), st.integers(1, 3), st.integers(1, 4),
    st.floats(0.1, 4), st.floats(0.1, 2), st.floats(0.05, 2), st.integers(0, 12), st.integers(0, 20), st.floats(1, 1.5))


@settings(max_examples=80, deadline=None)
@given(problems)
def test_optimal_matches_brute_force(p):
    best = brute_force(p)
    if best is None:
        with pytest.raises(PlanError):
            asym_ea.optimal(p)
        return
    k = asym_ea.optimal(p)
    assert asym_ea.memory_ok(p, k)
    assert asym_ea.objective(p, k) == pytest.approx(best, rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(problems)
def test_optimal_never_worse_than_greedy(p):
    assume(p.N % p.M == 0 or p.M % p.N == 0)
    try:
        g = asym_ea.gather_squeeze(p)
    except PlanError:
        return  # Algorithm 1 found nothing that fits
    k = asym_ea.optimal(p)
    assert asym_ea.objective(p, k) <= asym_ea.objective(p, g) + 1e-12


@settings(max_examples=60, deadline=None)
@given(problems, st.integers(1, 3))
def test_placement_holds_every_expert_once_within_memory(p, G):
    try:
        k = asym_ea.optimal(p)
    except PlanError:
        return
    M, N, E = p.M, p.N, p.num_experts
    groups = []
    for g in range(G):
        a = list(range(g * (M + N), g * (M + N) + M))
        x = list(range(g * (M + N) + M, (g + 1) * (M + N)))
        groups.append(ZPGroup(a, x, asym_ea.placement(k, E, a, x)))
    plan = HeteroPlan(p.num_layers, E, ["A40"] * (G * (M + N)), groups)
    plan.validate()  # every expert exactly once per layer, groups alike
    g0 = plan.groups[0]
    for l in range(p.num_layers):
        assert sum(len(g0.placement[l].get(r, [])) for r in g0.attention_ranks) == k[l]
    for r in g0.attention_ranks:
        assert sum(len(plan.local_experts(r, l)) for l in range(p.num_layers)) <= p.n_max
    for r in g0.expert_ranks:
        assert sum(len(plan.local_experts(r, l)) for l in range(p.num_layers)) <= p.cap_x


def test_any_m_to_n():
    p = prob(M=4, N=6, E=24, t_attn=1.0, t_exp=0.5, t_x=0.4)
    k = asym_ea.optimal(p)
    assert asym_ea.objective(p, k) < asym_ea.objective(p, [0] * 4)
    assert any(x % 4 for x in k) or any(x for x in k)
