"""The event simulator runs zebra inside pipeline stages (issue 28 item 2): each stage's task lists
over its own MoE layers and collectives over its own members, stages meeting through the
activations (P_F) and gradients (P_B) their attention ranks exchange.

Hand check: with one microbatch there is nothing to overlap, so zebra is the DistEP chain, which
the 1F1B model prices independently (planner/pipeline.py) and which is the one-stage chain plus
the two transfers. Then the trace against the lists' dependencies at 2 and 4 stages (Asym-EA in
a stage included), the C++ core against the Python reference, and the refusals that remain.
"""
import random

import pytest
from pp_small import GPUS, SMALL, S, cost

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import PlanError, even_plan
from megatron_hetermoe.plan.tasks import PipeTask, Task, inputs, zebra_tasks
from megatron_hetermoe.planner import pipeline
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.simulator import (
    build_problem,
    have_cpp,
    rank_task_times,
    run_cpp,
    run_python,
    simulate_plan,
)



def zplan(P: int, R: int, M: int = 1, N: int = 1, model: ModelConfig = SMALL, waves: int = 1, order: str = "gpipe"):
    plan = even_plan(model.num_layers, model.num_experts, M, N, attention_gpu=GPUS[0], expert_gpu=GPUS[1],
                     num_microbatches=R, pipeline_stages=P, schedule="zebra", zebra_waves=waves,
                     zebra_wave_order=order)
    return plan, Cluster.from_gpu_types(f"own-nodes-{P}-{M}-{N}", plan.gpu_types, gpus_per_node=1)


def test_one_microbatch_in_stages_is_the_distep_chain():
    """R = 1: zebra at 2 stages = the 1F1B model's DistEP at 2 stages = the one-stage chain + the
    activations' and the gradient's transfer (each S tokens x h x 2 bytes at the 12.5 GB/s NIC)."""
    c = cost()
    plan, cl = zplan(2, 1)
    z = simulate_plan(plan, c, cl, 1, engine="python")
    d = simulate_plan(plan, c, cl, 1, schedule="distep")
    assert z.makespan_s == pytest.approx(d.makespan_s, rel=1e-12)
    assert z.step_time_s == pytest.approx(d.step_time_s, rel=1e-12)  # the same post-step
    one, cl1 = zplan(1, 1)
    chain = simulate_plan(one, c, cl1, 1, engine="python").makespan_s
    prof = load_profiles(set(GPUS))
    lat = cl.network_latency_us * 1e-6 + max(prof[g].link_latency_us for g in GPUS) * 1e-6
    assert z.makespan_s == pytest.approx(chain + 2 * (lat + S * 1024 * 2 / 12.5e9), rel=1e-12)


def _offloaded(plan):
    """Asym-EA inside the last stage: its first attention rank holds expert 0 of the stage's first MoE layer."""
    P = plan.pipeline_stages
    att, exp = plan.stage_ranks(0, P - 1)
    layer = plan.stage_moe_layers(P - 1)[0]
    g = plan.groups[0]
    rest = [e for r in exp for e in g.placement[layer].get(r, []) if e != 0]
    g.placement[layer] = {att[0]: [0], **{r: rest[i::len(exp)] for i, r in enumerate(exp)}}
    plan.validate()
    return plan


@pytest.mark.parametrize("P,R,M,N,offload,W,order", [(2, 3, 1, 1, False, 1, "gpipe"), (2, 2, 2, 2, True, 1, "gpipe"),
                                                     (4, 3, 1, 2, True, 1, "gpipe"), (2, 4, 1, 1, False, 2, "gpipe"),
                                                     (4, 4, 2, 1, True, 4, "gpipe"), (4, 8, 1, 1, True, 4, "1f1b"),
                                                     (2, 6, 2, 1, False, 3, "1f1b")])
def test_trace_follows_the_stage_lists(P, R, M, N, offload, W, order):
    """Every rank runs its stage's zebra list in order (plus the transfers, issued where it produces
    or first needs them); compute waits for its inputs; a stage's collectives are over its members,
    one at a time per stream; a stage's first piece waits for the previous stage's output of that
    microbatch, its last piece's backward for the next stage's gradient."""
    plan, cl = zplan(P, R, M, N, waves=W, order=order)
    if offload:
        _offloaded(plan)
    c = cost()
    res = simulate_plan(plan, c, cl, R * M, dedup=False, keep_trace=True, engine="python")
    coll: dict = {}
    issued: dict = {}
    for r in range(plan.world_size):
        stage = plan.stage_of(r)
        L = len(plan.stage_moe_layers(stage))
        trace = res.trace_of(r)
        assert [t for t, _, _ in trace if not isinstance(t, PipeTask)] == zebra_tasks(plan, r)
        ends = {t: e for t, _, e in trace}
        prev_end = 0.0
        for n, (t, s, e) in enumerate(trace):
            if t.is_comm:
                key = ("pipe", t) if isinstance(t, PipeTask) else (stage, t)
                assert coll.setdefault(key, (s, e)) == (s, e)  # one transfer, the same times on every member
                issued.setdefault(key, []).append(prev_end)
                continue
            assert s >= prev_end - 1e-15
            dep = inputs(t, L)
            if dep is not None:
                assert s >= ends[dep] - 1e-15
            if plan.role(r) == "attention" and t == Task("A_F", 0, t.microbatch) and stage > 0:
                dep = PipeTask("P_F", stage - 1, t.microbatch)
                assert s >= ends[dep] - 1e-15
            if plan.role(r) == "attention" and t == Task("A_B", L, t.microbatch) and stage < P - 1:
                dep = PipeTask("P_B", stage + 1, t.microbatch)
                assert s >= ends[dep] - 1e-15
            # it waits for that transfer or collective and nothing else (a send is not waited for: the
            # runtime's isend; stage 0's next wave starts without the last one's transfer)
            ref = res.problem.ref[res.problem.ranks.index(r)][n]
            assert (res.problem.coll_tasks[ref] if ref >= 0 else None) == dep
            prev_end = e
    for key, times in issued.items():
        assert coll[key][0] >= max(times) - 1e-15  # starts when its last member issued it
        if key[0] == "pipe":
            assert len(times) == 2 * M  # the stage's M attention ranks and their M counterparts
        else:
            assert len(times) == M + N  # the stage's members, no one else
    streams: dict = {}
    for key, span in coll.items():
        t = key[1]
        sid = (key[0], t.stream) if key[0] != "pipe" else ("pipe", t.kind, t.layer)
        streams.setdefault(sid, []).append(span)
    for spans in streams.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
    assert res.makespan_s == pytest.approx(max(e for r in range(plan.world_size) for _, _, e in res.trace_of(r)))


def test_waves_pipeline_the_stages():
    """Theorem 1 over all R microbatches: stage 1 starts after stage 0's whole forward. In waves of
    R / W: after one wave's; the step shortens (4 stages of 1 + 1 ranks, R = 16, 1K tokens per
    microbatch: simulated 152.5 ms at W = 1, 81.1 ms at W = 4; one stage of 1 + 1 ranks: 162.3 ms)."""
    c = cost()
    steps, starts = {}, {}
    for W in (1, 4):
        plan, cl = zplan(4, 16, waves=W)
        res = simulate_plan(plan, c, cl, 16, dedup=False, keep_trace=True, engine="python")
        steps[W] = res.makespan_s
        f0 = [e for t, s, e in res.trace_of(0) if t.kind == "A_F" and t.layer < 2]  # stage 0's pieces but its last
        s1 = [s for t, s, e in res.trace_of(2) if t.kind == "A_F"]  # rank 2: stage 1's
        starts[W] = (min(s1), max(f0))
    assert starts[1][0] >= starts[1][1]  # stage 1 waits for all of stage 0's forward pieces
    assert starts[4][0] < 0.3 * starts[4][1]  # after its first wave
    assert steps[4] < 0.6 * steps[1]


def test_dedup_changes_no_time_in_stages():
    plan, cl = zplan(2, 4, 2, 2)
    c = cost()
    a = simulate_plan(plan, c, cl, 8, dedup=True, engine="python")
    b = simulate_plan(plan, c, cl, 8, dedup=False, engine="python")
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.utilization == pytest.approx(b.utilization, rel=1e-12)


@pytest.mark.skipif(not have_cpp(), reason="C++ core not built (python setup.py build_ext --inplace)")
@pytest.mark.parametrize("seed", range(6))
def test_cpp_matches_python_in_stages(seed):
    rnd = random.Random(seed)
    P, R = rnd.choice([2, 4]), rnd.randint(1, 4)
    W = rnd.choice([w for w in (1, 2, 4) if R % w == 0])
    plan, cl = zplan(P, R, rnd.randint(1, 2), rnd.randint(1, 3), waves=W, order=rnd.choice(["gpipe", "1f1b"][:W]))
    if rnd.random() < 0.5:
        _offloaded(plan)
    p = build_problem(plan, cost(), cl, plan.num_microbatches * 2, dedup=rnd.random() < 0.5)
    a, b = run_python(p), run_cpp(p)
    assert a.start == b.start and a.end == b.end and a.coll_start == b.coll_start and a.coll_end == b.coll_end


def test_rank_task_times_are_the_runtime_list():
    """The runtime's lists have no PipeTask (the executor does a stage's transfers around the
    attention tasks that consume and produce them); with_transfers: emulation's times keep
    them where plan.tasks.stage_transfers puts them."""
    from megatron_hetermoe.plan.tasks import stage_transfers

    plan, cl = zplan(2, 2)
    for r in range(plan.world_size):
        assert [t for t, _ in rank_task_times(plan, cost(), cl, 2, r)] == zebra_tasks(plan, r)
        want = []
        L = len(plan.stage_moe_layers(plan.stage_of(r)))
        for t in zebra_tasks(plan, r):
            recv, send = stage_transfers(t, plan.stage_of(r), 2, L) if plan.role(r) == "attention" else (None, None)
            want += [x for x in (recv, t, send) if x is not None]
        got = rank_task_times(plan, cost(), cl, 2, r, with_transfers=True)
        assert [t for t, _ in got] == want and all(d > 0 for t, d in got if isinstance(t, PipeTask))


def test_distep_in_stages_has_no_task_lists():
    plan, cl = zplan(2, 2)
    c = cost()
    with pytest.raises(PlanError, match="has no task lists"):
        build_problem(plan, c, cl, 2, schedule="distep")
    with pytest.raises(PlanError, match="no task lists to trace"):
        simulate_plan(plan, c, cl, 2, schedule="distep", keep_trace=True)
    with pytest.raises(PlanError, match="price zebra with simulator.simulate_plan"):
        pipeline.simulate_pipelined(plan, c, cl, 2)


# ---------------------------------------------------------------- the search
def test_zebra_in_stages_memory_keeps_every_microbatch():
    """Zebra runs all of a stage's forwards before a backward: R live microbatches on every stage
    (1F1B: P - i on stage i), so it never needs less memory than DistEP in the same stages."""
    plan, _ = zplan(4, 6, 1, 2)
    lay = pipeline.layout_of_plan(plan)
    c = cost()
    z = pipeline.pipeline_memory(lay, c, 6, zebra=True)
    d = pipeline.pipeline_memory(lay, c, 6)
    assert [r["alive"] for r in z] == [6] * 4 and [r["alive"] for r in d] == [4, 3, 2, 1]
    for a, b in zip(z, d):
        for role in ("attention", "expert"):
            assert a[role]["bytes"] >= b[role]["bytes"]


def test_zebra_in_1f1b_order_over_waves_keeps_the_warm_up_groups_alive():
    """4 stages, R 8: in 4 waves of 2 in 1F1B's order stage i holds min(4, 4 - i) groups of 2 (8, 6,
    4, 2 microbatches), in 8 waves of 1 min(8, 4 - i) (4, 3, 2, 1: DistEP's 1F1B), in GPipe's order
    all 8; less alive, fewer bytes on every rank."""
    c = cost()
    rows = {}
    for W, order in ((4, "gpipe"), (4, "1f1b"), (8, "1f1b")):
        plan, _ = zplan(4, 8, 1, 2, waves=W, order=order)
        lay = pipeline.layout_of_plan(plan)
        rows[W, order] = pipeline.pipeline_memory(lay, c, 8, zebra=True, waves=W, order=order)
    assert [r["alive"] for r in rows[4, "gpipe"]] == [8] * 4
    assert [r["alive"] for r in rows[4, "1f1b"]] == [8, 6, 4, 2]
    assert [r["alive"] for r in rows[8, "1f1b"]] == [4, 3, 2, 1]
    for i in range(1, 4):
        for role in ("attention", "expert"):
            assert rows[4, "1f1b"][i][role]["bytes"] < rows[4, "gpipe"][i][role]["bytes"]
            assert rows[8, "1f1b"][i][role]["bytes"] < rows[4, "1f1b"][i][role]["bytes"]


def test_zebra_lower_bound_never_exceeds_the_simulated_step():
    from megatron_hetermoe.planner.search import build_plan, candidates

    m = ModelConfig.load("mixtral-8x7b")
    cl = Cluster.load("h100x16-v100x16")
    c = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(4096))
    types = cl.gpu_types()
    checked = 0
    for n, cand in enumerate(candidates(cl, m, 64, 32, 4096, pipeline_stages=(2, 4, 8))[::9]):
        M, N = cand.stage_shape
        t = 64 * 4096 / (cand.G * M * cand.R)
        lay = pipeline.even_layout(m, types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.P, cand.R, cand.tp)
        divisors = [w for w in range(1, cand.R + 1) if cand.R % w == 0]
        for W in {1, cand.R, divisors[n % len(divisors)]}:
            lb = pipeline.zebra_lower_bound(c, cl, {types[cand.attention_ranks[0]]}, {types[cand.expert_ranks[0]]}, t,
                                            M * t * 2 / 8, lay, W)
            for order in ("gpipe", "1f1b") if W > 1 else ("gpipe",):  # the bound holds in either order
                plan = build_plan(m, types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.R, [0] * 32, "zebra",
                                  skeleton=True, attention_tp=cand.tp, pipeline_stages=cand.P, zebra_waves=W,
                                  zebra_wave_order=order)
                assert 0 < lb <= simulate_plan(plan, c, cl, 64).step_time_s
                checked += 1
    assert checked >= 5


def test_search_picks_zebra_in_stages_where_it_is_fastest():
    """The hand-sized model on 4 A40 + 4 V100 at 16 sequences, 2 stages only: zebra in the stages
    overlaps attention and experts inside each stage and beats DistEP's 1F1B on the same layout;
    the plan it returns validates and simulates to the predicted step."""
    from megatron_hetermoe.planner.search import PICK, build_plan, search

    cl = Cluster.from_gpu_types("4+4", ["A40"] * 4 + ["V100-16GB"] * 4)
    res = search(SMALL, cl, S, 16, baselines=False, pipeline_stages=(2,))
    plan, pick = res.plan, res.by_name()[PICK]
    assert (plan.schedule == "zebra" and plan.pipeline_stages == 2
            and "zebra in 2 pipeline stages" in plan.meta["assignment"])
    assert pick.detail["zebra_waves"] == plan.zebra_waves and f"({plan.zebra_waves} wave(s)" in plan.meta["assignment"]
    plan.validate(world_size=8)
    c = CostModel(SMALL, load_profiles(set(GPUS)), TrainSettings(S, expert_recompute=plan.expert_recompute))
    assert simulate_plan(plan, c, cl, 16).step_time_s == pytest.approx(pick.step_time_s, rel=1e-12)
    g = plan.groups
    same = build_plan(SMALL, cl.gpu_types(), [r for x in g for r in x.attention_ranks],
                      [r for x in g for r in x.expert_ranks], len(g), plan.num_microbatches, [0] * 8, "distep",
                      attention_tp=plan.attention_tp, pipeline_stages=2)
    assert simulate_plan(same, c, cl, 16).step_time_s > pick.step_time_s


@pytest.mark.parametrize("seed", range(16))
def test_zebra_lower_bound_holds_on_small_plans(seed):
    """Dense layers moved across a stage boundary, several groups, attention TP, R = 1..4, waves in
    either order, Asym-EA inside the stages (experts on attention ranks: the expert term counts
    expert ranks only)."""
    from megatron_hetermoe.planner.search import build_plan

    rnd = random.Random(seed)
    freq = [1] * 8
    for d in rnd.sample(range(1, 8), rnd.randint(0, 2)):
        freq[d] = 0
    m = SMALL.replace(moe_layer_freq=freq)
    P, G, tp, R = rnd.choice([2, 4]), rnd.choice([1, 2]), rnd.choice([1, 2]), rnd.randint(1, 4)
    W = rnd.choice([w for w in range(1, R + 1) if R % w == 0])
    order = rnd.choice(["gpipe", "1f1b"]) if W > 1 else "gpipe"
    if any(not any(freq[i * 8 // P:(i + 1) * 8 // P]) for i in range(P)):
        P = 2 if all(any(freq[i * 4:(i + 1) * 4]) for i in range(2)) else 1
    if P == 1:
        pytest.skip("a stage without MoE layer")
    M, N = tp * rnd.randint(1, 2), rnd.randint(1, 2)
    types = ["A40"] * (G * P * M) + ["V100-16GB"] * (G * P * N)
    cl = Cluster.from_gpu_types(f"lb-{seed}", types, gpus_per_node=4)
    attn, exp = list(range(G * P * M)), list(range(G * P * M, len(types)))
    c = CostModel(m, load_profiles(set(GPUS)), TrainSettings(S))
    k = [rnd.choice([0, 0, 1, 3, 8]) for _ in range(m.num_moe_layers)] if tp == 1 else [0] * m.num_moe_layers
    plan = build_plan(m, types, attn, exp, G, R, k, "zebra", attention_tp=tp, pipeline_stages=P, zebra_waves=W,
                      zebra_wave_order=order)
    lay = pipeline.layout_of_plan(plan)
    B = G * (M // tp) * R
    t = B * S / (G * M * R)
    lb = pipeline.zebra_lower_bound(c, cl, {"A40"}, {"V100-16GB"}, t, M * t * 2 / 8, lay, W)
    assert 0 < lb <= simulate_plan(plan, c, cl, B).step_time_s


def test_stage_asym_problem_at_one_stage_is_the_search_asym_problem():
    """One stage: the per-stage Asym-EA inputs (pieces, head, memory over the stage's pieces) are
    the one-stage search's, term by term."""
    from megatron_hetermoe.planner.search import asym_problem, stage_asym_problem

    m = SMALL.replace(moe_layer_freq=[1, 1, 0, 1, 1, 1, 1, 1])
    types = ["A40"] * 4 + ["V100-16GB"] * 4
    c = CostModel(m, load_profiles(set(GPUS)), TrainSettings(S))
    for G, R in ((1, 4), (2, 2)):
        lay = pipeline.even_layout(m, types, [0, 1, 2, 3], [4, 5, 6, 7], G, 1, R)
        a = stage_asym_problem(c, lay, 0, 16)
        b = asym_problem(c, types, [0, 1, 2, 3][:4 // G], [4, 5, 6, 7][:4 // G], G, R, 16, forward_only=False)
        assert (a.num_layers, a.num_experts, a.M, a.N, a.n_max, a.cap_x) == (b.num_layers, b.num_experts, b.M, b.N,
                                                                             b.n_max, b.cap_x)
        assert a.t_attn == pytest.approx(b.t_attn, rel=1e-12) and a.t_attn_extra == pytest.approx(b.t_attn_extra)
        assert (a.t_exp, a.t_exp_on_attn) == pytest.approx((b.t_exp, b.t_exp_on_attn), rel=1e-12)
