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


def test_run_pricing_prices_a_run_on_its_own_gpus_and_steps_aside_on_cpu_ranks():
    """Outside emulation (planner/rebalance.run_pricing): the plan's GPU types with shipped profiles,
    nodes of one type as `hetermoe plan --even` prices them, the run's own model and batch, and the
    move cost the caller measured; None for CPU ranks (the measured-time rule decides there)."""
    from megatron_hetermoe.config import ModelConfig
    from megatron_hetermoe.planner.cluster import Cluster
    from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
    from megatron_hetermoe.planner.profiles import load_profiles
    from megatron_hetermoe.planner.rebalance import run_pricing

    model = ModelConfig.load("tiny")
    plan = _plan()
    cpu = HeteroPlan.from_dict({**plan.to_dict(), "gpu_types": ["cpu"] * 3})
    assert run_pricing(cpu, model, 64, 8) is None
    decide = run_pricing(plan, model, 64, 8, cfg=RebalanceConfig(margin=0.0))
    prop = decide(plan, HOT, 10, lambda n: 0.0)
    cost = CostModel(model.replace(seq_length=64), load_profiles(set(plan.gpu_types)),
                     TrainSettings(64, activation_checkpointing=False, expert_recompute=plan.expert_recompute))
    want = propose_simulated(plan, HOT, 10, cost, Cluster.from_gpu_types("x", plan.gpu_types), 8, lambda n: 0.0,
                             RebalanceConfig(margin=0.0))
    assert prop.plan is not None and prop.reason.startswith("simulated step"), prop.reason
    assert (prop.seconds_now, prop.seconds_new) == (want.seconds_now, want.seconds_new)
    assert prop.plan.to_dict() == want.plan.to_dict()
    # The measured move cost is what the hysteresis weighs (the default margin, 2).
    costly = run_pricing(plan, model, 64, 8)(plan, HOT, 10, lambda n: 1e3)
    assert costly.plan is None and "move cost" in costly.reason, costly.reason
