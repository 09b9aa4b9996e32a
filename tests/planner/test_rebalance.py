"""The live placement rule (planner/rebalance.py): where a planted skew moves experts, and where
hysteresis keeps them (balanced loads, noise, a move that does not pay, experts just moved)."""
from __future__ import annotations

import pytest

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, ZPGroup, even_plan
from megatron_hetermoe.planner.rebalance import (
    RebalanceConfig,
    check_same_roles,
    holdings,
    predicted_seconds,
    propose,
    seconds_per_token,
    with_placement,
)

FREE = RebalanceConfig(margin=0.0)


def _plan(groups: int = 1) -> HeteroPlan:
    """2 attention + 2 expert ranks per group, 2 layers x 4 experts: experts 0, 1 on the first expert rank."""
    return even_plan(2, 4, 2, 2, groups=groups, num_microbatches=2)


def _seconds(plan: HeteroPlan, spt: dict[int, float], tokens) -> list[dict[str, float]]:
    """Task seconds as measured: each rank's received tokens times its seconds per token."""
    G = len(plan.groups)
    out = [{} for _ in range(plan.world_size)]
    for g in plan.groups:
        for l, pl in enumerate(g.placement):
            for r, es in pl.items():
                out[r]["E_F"] = out[r].get("E_F", 0.0) + sum(tokens[l][e] for e in es) / G * spt.get(r, 1.0)
    return out


def _hot(a: float = 100.0, b: float = 100.0) -> list[list[float]]:
    return [[a, b, 1.0, 1.0], [a, b, 1.0, 1.0]]


def test_a_planted_hot_pair_is_split_within_memory():
    plan = _plan()
    tokens = _hot()
    p = propose(plan, tokens, _seconds(plan, {}, tokens), 4, 4, lambda n: 0.0, "distep", cfg=FREE)
    assert p.plan is not None and p.seconds_new < 0.6 * p.seconds_now
    for l in range(2):
        owner = p.plan.groups[0].owner(l)
        assert {owner[0], owner[1]} == {2, 3}
    assert holdings(p.plan) == holdings(plan)  # each rank's memory as the plan gave it
    check_same_roles(plan, p.plan)


@pytest.mark.parametrize("tokens", [[[10.0] * 4] * 2, [[10.3, 10.0, 10.0, 10.2]] * 2], ids=["balanced", "noise"])
def test_balanced_or_noisy_loads_do_not_move(tokens):
    plan = _plan()
    p = propose(plan, tokens, _seconds(plan, {}, tokens), 4, 4, lambda n: 0.0, "distep")
    assert p.plan is None, p


def test_a_move_that_does_not_pay_its_cost_is_not_made():
    plan = _plan()
    tokens = _hot()
    secs = _seconds(plan, {}, tokens)
    cheap = propose(plan, tokens, secs, 4, 4, lambda n: 1e-6 * n, "distep", cfg=RebalanceConfig(margin=2.0))
    assert cheap.plan is not None
    saving = (cheap.seconds_now - cheap.seconds_new) * 4
    dear = propose(plan, tokens, secs, 4, 4, lambda n: saving / 2 * 1.01, "distep",
                   cfg=RebalanceConfig(margin=2.0))
    assert dear.plan is None and "move cost" in dear.reason


def test_experts_just_moved_stay():
    plan = _plan()
    tokens = _hot()
    p = propose(plan, tokens, _seconds(plan, {}, tokens), 4, 4, lambda n: 0.0, "distep", cfg=FREE,
                frozen={(0, 0), (0, 1), (1, 0), (1, 1)})
    assert p.plan is None or all(p.plan.groups[0].owner(l)[e] == 2 for l in range(2) for e in (0, 1))


def test_a_slower_rank_gets_less_work():
    """Expert rank 3 takes 3x the time per token: it ends with fewer tokens than rank 2."""
    plan = _plan()
    tokens = [[40.0, 30.0, 20.0, 10.0]] * 2
    secs = _seconds(plan, {2: 1.0, 3: 3.0}, tokens)
    spt = seconds_per_token(plan, tokens, secs)
    assert spt[2] == pytest.approx(1.0) and spt[3] == pytest.approx(3.0)
    cap = {0: 0, 1: 0, 2: 8, 3: 8}  # room for every expert on either rank
    p = propose(plan, tokens, secs, 1, 4, lambda n: 0.0, "distep", capacity=cap, cfg=FREE)
    assert p.plan is not None
    for l in range(2):
        pl = p.plan.groups[0].placement[l]
        load = {r: sum(tokens[l][e] for e in pl.get(r, [])) for r in (2, 3)}
        assert load[3] < load[2]
        assert max(load[2] * 1.0, load[3] * 3.0) == 80.0  # the optimum: {40, 30, 10} on rank 2, {20} on rank 3


def test_zebra_prices_a_holder_over_all_layers():
    plan = _plan()
    per_step = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    pl = [dict(p) for p in plan.groups[0].placement]  # layer 0's load on rank 2, layer 1's on rank 3
    assert predicted_seconds(plan, pl, per_step, [1.0] * 4, "zebra") == 1.0
    assert predicted_seconds(plan, pl, per_step, [1.0] * 4, "distep") == 2.0


def test_every_group_moves_alike_and_roles_stay():
    plan = _plan(groups=2)
    tokens = _hot()
    p = propose(plan, tokens, _seconds(plan, {}, tokens), 4, 4, lambda n: 0.0, "zebra", cfg=FREE)
    assert p.plan is not None
    check_same_roles(plan, p.plan)  # the same experts at the same member positions in both groups
    g0, g1 = p.plan.groups
    for l in range(2):
        for r0, r1 in zip(g0.members, g1.members):
            assert sorted(g0.placement[l].get(r0, [])) == sorted(g1.placement[l].get(r1, []))


def test_a_changed_role_or_schedule_is_refused():
    plan = _plan()
    other = with_placement(plan, [{2: [0, 1], 3: [2, 3]}] * 2)
    other.schedule = "zebra" if plan.schedule != "zebra" else "distep"
    with pytest.raises(PlanError, match="schedule"):
        check_same_roles(plan, other)
    swapped = HeteroPlan(2, 4, ["cpu"] * 4, [ZPGroup([0, 2], [1, 3], [{1: [0, 1], 3: [2, 3]}] * 2)],
                         num_microbatches=2, schedule=plan.schedule)
    with pytest.raises(PlanError, match="groups"):
        check_same_roles(plan, swapped)


def test_nothing_measured_moves_nothing():
    plan = _plan()
    p = propose(plan, [[0.0] * 4] * 2, [{}] * 4, 0, 4, lambda n: 0.0, "distep", cfg=FREE)
    assert p.plan is None and p.reason == "no tokens measured"
