"""Event simulator: executes exactly the plan.tasks lists, respects every dependency and
stream, matches a hand computation, and the C++ core agrees with the Python reference."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.tasks import Task, inputs, tasks_for_rank, zebra_tasks
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.search import build_plan
from megatron_hetermoe.planner.simulator import (
    build_problem,
    have_cpp,
    run_cpp,
    run_python,
    simulate_plan,
)


def setup(M, N, L=3, E=6, G=1, R=3, k=None, types=("A40", "V100-16GB"), seq=2048, schedule="zebra"):
    model = ModelConfig.load("d1").replace(num_layers=L, num_experts=E)
    cl = Cluster.of("t", {types[0]: M * G, types[1]: N * G}, nic_gbps=100, gpus_per_node=4)
    gpu = cl.gpu_types()
    attn = [r for r, t in enumerate(gpu) if t == types[0]]
    exp = [r for r, t in enumerate(gpu) if t == types[1]]
    plan = build_plan(model, gpu, attn, exp, G, R, k or [0] * L, schedule)
    cost = CostModel(model, load_profiles(set(types)), TrainSettings(seq))
    return plan, cost, cl


def test_hand_computed_single_pair():
    plan, cost, cl = setup(1, 1, L=1, E=2, R=1)
    p = build_problem(plan, cost, cl, global_batch=2, dedup=False)
    dur = {t: d for tasks, ds in zip(p.tasks, p.dur) for t, d in zip(tasks, ds) if not t.is_comm}
    comm = {t: d for t, d in zip(p.coll_tasks, p.coll_dur)}
    T = Task
    want = (dur[T("A_F", 0, 0)] + comm[T("D_F", 0, 0)] + dur[T("E_F", 0, 0)] + comm[T("C_F", 0, 0)]
            + dur[T("A_F", 1, 0)] + dur[T("A_B", 1, 0)] + comm[T("C_B", 0, 0)] + dur[T("E_B", 0, 0)]
            + comm[T("D_B", 0, 0)] + dur[T("A_B", 0, 0)])
    res = simulate_plan(plan, cost, cl, 2, engine="python")
    assert res.makespan_s == pytest.approx(want, rel=1e-12)
    assert res.step_time_s == pytest.approx(want + max(p.post_step), rel=1e-12)


@pytest.mark.parametrize("schedule", ["zebra", "distep"])
def test_simulated_order_is_the_task_list(schedule):
    plan, cost, cl = setup(2, 2, L=3, E=6, R=3, k=[2, 0, 3], schedule=schedule)
    res = simulate_plan(plan, cost, cl, 12, dedup=False, keep_trace=True, engine="python")
    L = plan.num_layers
    coll = {}
    for r in range(plan.world_size):
        trace = res.trace_of(r)
        assert [t for t, _, _ in trace] == tasks_for_rank(plan, r)  # same tasks, same order
        ends = {t: e for t, _, e in trace}
        prev_end, issue = 0.0, 0.0
        for t, s, e in trace:
            if t.is_comm:
                assert s >= issue - 1e-15  # starts after this rank issued it
                coll.setdefault(t, (s, e))
                assert coll[t] == (s, e)  # one collective, same times on every member
            else:
                assert s >= prev_end - 1e-15  # one compute task at a time, in list order
                dep = inputs(t, L)
                if dep is not None:
                    assert s >= ends[dep] - 1e-15
                prev_end = issue = e
    # the compute stream's order by start time equals the list's compute order
    for r in range(plan.world_size):
        comp = [(s, i, t) for i, (t, s, _) in enumerate(res.trace_of(r)) if not t.is_comm]
        assert [t for _, _, t in sorted(comp)] == [t for t in tasks_for_rank(plan, r) if not t.is_comm]
    for stream in ("dispatch", "combine"):
        spans = sorted(v for t, v in coll.items() if t.stream == stream)
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))  # one at a time


def test_dedup_changes_no_time():
    plan, cost, cl = setup(3, 2, L=2, E=6, R=2, k=[1, 4], G=2)
    a = simulate_plan(plan, cost, cl, 24, dedup=True, engine="python")
    b = simulate_plan(plan, cost, cl, 24, dedup=False, engine="python")
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.utilization == pytest.approx(b.utilization)


def test_one_microbatch_zebra_is_distep():
    plan, cost, cl = setup(2, 2, R=1)
    z = simulate_plan(plan, cost, cl, 4, schedule="zebra").step_time_s
    d = simulate_plan(plan, cost, cl, 4, schedule="distep").step_time_s
    assert z == pytest.approx(d, rel=1e-12)
    plan4, *_ = setup(2, 2, R=4)
    assert (simulate_plan(plan4, cost, cl, 8, schedule="zebra").step_time_s
            < simulate_plan(plan4, cost, cl, 8, schedule="distep").step_time_s)


def _cycle_problem():
    # rank 0 computes (waiting for collective 1) before it issues collective 0; rank 1 computes
    # (waiting for collective 0) before it issues collective 1: neither can ever start
    from megatron_hetermoe.planner.simulator import SimProblem

    T = Task
    return SimProblem(ranks=[0, 1], multiplicity=[1, 1], roles=["attention", "expert"], gpus=["A40", "V100-16GB"],
                      tasks=[[T("A_F", 1, 0), T("D_F", 0, 0)], [T("E_F", 0, 0), T("C_F", 0, 0)]],
                      is_comm=[[0, 1], [0, 1]], dur=[[1.0, 0.0], [1.0, 0.0]], ref=[[1, 0], [0, 1]],
                      coll_tasks=[T("D_F", 0, 0), T("C_F", 0, 0)], coll_stream=[0, 1], coll_dur=[0.5, 0.5])


def test_bad_lists_deadlock_loudly():
    with pytest.raises(RuntimeError, match="deadlock"):
        run_python(_cycle_problem())
    if have_cpp():
        with pytest.raises(RuntimeError, match="deadlock"):
            run_cpp(_cycle_problem())


@pytest.mark.skipif(not have_cpp(), reason="C++ core not built (python setup.py build_ext --inplace)")
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 2),
       st.sampled_from(["zebra", "distep"]), st.integers(0, 10**6))
def test_cpp_matches_python_on_random_plans(M, N, L, R, G, schedule, seed):
    rnd = random.Random(seed)
    E = rnd.randint(max(N, 2), 3 * max(N, 2))
    k = [rnd.randint(0, E) for _ in range(L)]
    types = rnd.choice([("A40", "V100-16GB"), ("L40S", "T4"), ("H100", "A100-80GB")])
    plan, cost, cl = setup(M, N, L=L, E=E, G=G, R=R, k=k, types=types, seq=rnd.choice([512, 4096]), schedule=schedule)
    p = build_problem(plan, cost, cl, global_batch=G * M * R * rnd.randint(1, 2), dedup=rnd.random() < 0.5)
    a, b = run_python(p), run_cpp(p)
    assert a.start == b.start and a.end == b.end and a.coll_start == b.coll_start and a.coll_end == b.coll_end


def test_plan_world_and_model_must_match():
    plan, cost, cl = setup(1, 1)
    from megatron_hetermoe.plan.hetero_plan import PlanError

    with pytest.raises(PlanError, match="cluster"):
        simulate_plan(plan, cost, Cluster.load("o1"), 4)
    with pytest.raises(PlanError, match="model"):
        simulate_plan(plan, CostModel(ModelConfig.load("d2"), cost.profiles, cost.settings), cl, 4)


def test_rank_task_times_for_emulation():
    from megatron_hetermoe.planner.simulator import compute_task_time, rank_task_times

    plan, cost, cl = setup(2, 2, L=2, E=4, R=2, k=[2, 0])
    times = rank_task_times(plan, cost, cl, 8, rank=0)
    assert [t for t, _ in times] == zebra_tasks(plan, 0)
    t_mb = 8 * cost.settings.seq_len / (2 * 2)
    d = dict(times)
    assert d[Task("A_F", 1, 0)] == compute_task_time(cost, "A40", Task("A_F", 1, 0), t_mb)
    assert d[Task("X_F", 0, 1)] == compute_task_time(cost, "A40", Task("X_F", 0, 1), t_mb, 1, 2 * t_mb * 2 / 4)
    assert all(s >= 0 for _, s in times) and d[Task("D_F", 0, 0)] > 0
