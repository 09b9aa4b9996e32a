"""planner/rebalance.propose_simulated: an emulated run's live-move decision, judged by the simulator
on the emulated cluster (the load-aware placement of planner/load_placement for the measured loads,
taken only where predicted faster, with propose's hysteresis). 1 A40 attention rank + 2 V100
expert ranks, 4 experts of which 0 and 1 (both on rank 1) take every token."""
from __future__ import annotations

import pytest

from megatron_hetermoe.config import EmulationSpec
from megatron_hetermoe.emulation.emulator import Emulator
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
from megatron_hetermoe.planner.expert_load import ExpertLoad
from megatron_hetermoe.planner.rebalance import RebalanceConfig, check_same_roles, propose_simulated
from megatron_hetermoe.planner.simulator import simulate_plan

from emulated_small import CLUSTER, GB, MODEL, SEQ

HOT = [[4.0, 4.0, 0.0, 0.0], [4.0, 4.0, 0.0, 0.0]]


def _plan() -> HeteroPlan:
    g = ZPGroup([0], [1, 2], [{1: [0, 1], 2: [2, 3]}, {1: [0, 1], 2: [2, 3]}])
    return HeteroPlan(2, 4, ["A40", "V100-16GB", "V100-16GB"], [g], num_microbatches=2, schedule="zebra")


@pytest.fixture
def em(tmp_path) -> Emulator:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "model.yaml").write_text(MODEL)
    return Emulator(EmulationSpec(str(tmp_path / "cluster.yaml"), str(tmp_path / "model.yaml"), SEQ, GB))


def _propose(em, plan, tokens, margin=2.0, cost_s=0.0):
    return propose_simulated(plan, tokens, 10, em.cost, em.cluster, GB, lambda n: cost_s * n,
                             RebalanceConfig(margin=margin))


def test_a_planted_hot_pair_is_split_where_the_simulator_predicts_it_faster(em):
    plan = _plan()
    prop = _propose(em, plan, HOT)
    assert prop.plan is not None, prop.reason
    check_same_roles(plan, prop.plan)
    load = ExpertLoad.of(HOT)
    before = simulate_plan(plan, em.cost, em.cluster, GB, expert_load=load).step_time_s
    after = simulate_plan(prop.plan, em.cost, em.cluster, GB, expert_load=load).step_time_s
    assert (prop.seconds_now, prop.seconds_new) == pytest.approx((before, after))
    assert after < before * 0.95
    holders = {r for l in range(2) for r, es in prop.plan.groups[0].placement[l].items() if {0, 1} & set(es)}
    assert len(holders) >= 2  # the hot experts no longer share one rank


def test_balanced_loads_and_moves_that_do_not_pay_stay(em):
    plan = _plan()
    assert _propose(em, plan, [[1.0] * 4] * 2).plan is None
    assert _propose(em, plan, [[0.0] * 4] * 2).reason == "no tokens measured"
    costly = _propose(em, plan, HOT, cost_s=1e3)
    assert costly.plan is None and "move cost" in costly.reason and costly.moved
