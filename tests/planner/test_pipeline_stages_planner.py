"""The planner's pipeline stages (issue 28 item 5): HeterMoE plans with pipeline_stages P > 1 are
priced by planner/pipeline.py (DistEP inside the stages, Megatron's 1F1B across them) and
searched next to one-stage plans.

Hand checks: the 1F1B step formula, the layer split into attention pieces, 1F1B's live
microbatches per stage and what they cost in memory, the P2P transfer; cross-checks against the
event simulator (one stage: the DistEP makespan; two stages: the one-stage chain split in two);
and a search that needs P > 1 (Mixtral-8x7B on 16 H100 + 16 V100-32GB at 64 sequences of 4K:
no one-stage plan fits) returning a plan that validates and prices as the search said.
"""
import dataclasses
import json

import pytest
from pp_small import GPUS, SMALL, S, cost

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import PlanError, even_plan
from megatron_hetermoe.planner import pipeline
from megatron_hetermoe.planner.cli_plan import main
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.pipeline import (
    even_layout,
    layout_of_plan,
    live_microbatches,
    memory_shortfall,
    one_f_one_b_step,
    pipeline_memory,
    price,
    stage_pieces,
)
from megatron_hetermoe.planner.profiles import known_gpu_types, load_profiles
from megatron_hetermoe.planner.search import PICK, build_plan, candidates, search
from megatron_hetermoe.planner.simulator import build_problem, rank_task_times, simulate_plan



# ---------------------------------------------------------------- the 1F1B formula
def test_one_f_one_b_step_by_hand():
    # equal stages: fill (P - 1) stages, then R microbatches at the stage time
    assert one_f_one_b_step([2.0] * 4, 8) == pytest.approx((4 + 8 - 1) * 2.0)
    # unequal: 1 + 2 + 3 = 6 to fill and drain one microbatch, then 3 more at the slowest stage's 3 s
    assert one_f_one_b_step([1.0, 2.0, 3.0], 4) == pytest.approx(15.0)
    assert one_f_one_b_step([3.0, 1.0, 2.0], 1) == pytest.approx(6.0)  # one microbatch: no steady state
    with pytest.raises(ValueError):
        one_f_one_b_step([1.0], 0)
    # 1F1B keeps P - i microbatches alive on stage i (Megatron's warm-up forwards + 1), at most R
    assert [live_microbatches(4, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [live_microbatches(4, i, 2) for i in range(4)] == [2, 2, 2, 1]


# ---------------------------------------------------------------- the layer split
def test_stage_pieces_by_hand():
    # model layers 0..5, dense 0 and 3 (MoE layers k=0..3 are model 1, 2, 4, 5), 2 stages of 3:
    # stage 0 runs dense 0 before MoE 0; stage 1 dense 3 before MoE 2, and the head (L = 4)
    layers, pieces = stage_pieces([1, 2, 4, 5], 6, 2)
    assert layers == [[0, 1], [2, 3]]
    assert pieces == [[(0, 1), (1, 0)], [(2, 1), (3, 0), (4, 0)]]
    # dense model layer 2 ends stage 0, whose next MoE layer is on stage 1: it runs with stage 0's last piece
    layers, pieces = stage_pieces([0, 1, 3, 4, 5], 6, 2)
    assert layers == [[0, 1], [2, 3, 4]] and pieces == [[(0, 0), (1, 1)], [(2, 0), (3, 0), (4, 0), (5, 0)]]
    # one stage: the zebra stages with their own dense layers (cost_model.dense_in_stage)
    m = SMALL.replace(num_layers=6, moe_layer_freq=[1, 1, 0, 1, 1, 1])
    assert stage_pieces(m.moe_layer_ids, 6, 1)[1] == [list(enumerate(cost(m).dense_in_stage))]
    with pytest.raises(PlanError, match="does not divide the 6 decoder layers"):
        stage_pieces([0, 1, 3, 4, 5], 6, 4)
    with pytest.raises(PlanError, match="hold no MoE layer"):
        stage_pieces([3, 4, 5], 6, 2)


@pytest.mark.parametrize("freq", [1, [1, 1, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 1, 0]])
def test_pieces_hold_the_whole_model_once(freq):
    m = SMALL.replace(moe_layer_freq=freq, moe_shared_expert_intermediate_size=1024)
    c = cost(m)
    L = c.num_layers
    one = sum(c.stage_time("A40", s, 2048.0, b) for s in range(L + 1) for b in (False, True))
    for P in (1, 2, 4):
        _, pieces = pipeline.model_pieces(m, P)
        params = sum(c.pipeline_stage_params(pieces[i], i == 0, i == P - 1) for i in range(P))
        assert params == m.non_expert_params()
        t = sum(c.stage_time("A40", s, 2048.0, b, dense=d) for ps in pieces for s, d in ps for b in (False, True))
        assert t == pytest.approx(one, rel=1e-12)  # dense layers move between stages, none is lost or doubled


@pytest.mark.parametrize("kw", [{}, {"activation_checkpointing": False}, {"expert_recompute": "resend-inputs"},
                                {"distributed_optimizer": True}])
def test_one_stage_attention_memory_is_the_existing_rule(kw):
    m = SMALL.replace(moe_layer_freq=[1, 1, 0, 1, 1, 1, 0, 1], moe_shared_expert_intermediate_size=1024)
    c = cost(m, **kw)
    pieces = pipeline.model_pieces(m, 1)[1][0]
    for tp, dp in ((1, 1), (2, 4), (4, 2)):
        assert c.pipeline_attention_rank_bytes(3000.0, 3, pieces, True, True, tp, dp) == pytest.approx(
            c.attention_rank_bytes(3000.0, 3, tp=tp, dp=dp), rel=1e-12)


# ---------------------------------------------------------------- against the event simulator
@pytest.mark.parametrize("case", [("o1", 1, 4, 0, 1), ("o1", 2, 2, 1, 1), ("o2", 4, 3, 0, 1), ("o1", 1, 2, 0, 2)])
def test_one_stage_prices_as_the_event_simulators_distep(case):
    """With P = 1, R x the DistEP chain + post-step is the event simulator's DistEP step (Asym-EA
    experts on attention ranks, several groups and attention TP included)."""
    name, G, R, offload, tp = case
    cl = Cluster.load(name)
    types = cl.gpu_types()
    a = cl.ranks_of("A40")
    x = [r for r in range(cl.world_size) if r not in a]
    for level in ("keep-inputs", "resend-inputs"):
        c = cost(expert_recompute=level)
        plan = build_plan(SMALL, types, a, x, G, R, [offload] * SMALL.num_layers, "distep", attention_tp=tp)
        B = 2 * len(a) // tp * R
        ev = simulate_plan(plan, c, cl, B, engine="python")
        pp = pipeline.simulate_pipelined(plan, c, cl, B)
        assert pp.step_time_s == pytest.approx(ev.step_time_s, rel=1e-9)
        assert pp.makespan_s == pytest.approx(ev.makespan_s, rel=1e-9)
        assert pp.utilization == pytest.approx(ev.utilization, rel=1e-9)


def test_two_stages_split_the_one_stage_chain_and_add_the_p2p():
    """Every rank on its own node (the same links everywhere): the two stages' forward + backward
    add up to the one-stage DistEP chain of one microbatch (the event simulator's makespan at
    R = 1); stage 0 adds the P2P of its activations and their gradient; step = 1F1B + post."""
    R = 6
    plan = even_plan(8, 8, 1, 1, attention_gpu="A40", expert_gpu="V100-16GB", num_microbatches=R, pipeline_stages=2)
    assert plan.gpu_types == ["A40", "V100-16GB"] * 2
    cl = Cluster.from_gpu_types("own-nodes", plan.gpu_types, gpus_per_node=1)
    one = even_plan(8, 8, 1, 1, attention_gpu="A40", expert_gpu="V100-16GB", num_microbatches=1)
    cl1 = Cluster.from_gpu_types("own-nodes-1", one.gpu_types, gpus_per_node=1)
    c = cost()
    res = simulate_plan(plan, c, cl, R)  # one sequence per microbatch: S tokens on each attention rank
    chain = simulate_plan(one, c, cl1, 1, engine="python").makespan_s
    d = res.detail
    assert d["pipeline_stages"] == 2 and d["stage_moe_layers"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sum(d["stage_forward_s"]) + sum(d["stage_backward_s"]) == pytest.approx(chain, rel=1e-12)
    # P2P: S tokens x h x 2 bytes, there and back, at the 100 Gb/s NIC (12.5 GB/s) + latency
    prof = load_profiles(set(GPUS))
    lat = cl.network_latency_us * 1e-6 + max(prof[g].link_latency_us for g in GPUS) * 1e-6
    assert d["p2p_s"] == pytest.approx([2 * (lat + S * 1024 * 2 / 12.5e9), 0.0], rel=1e-12)
    T = d["stage_times_s"]
    assert T == pytest.approx([f + b + p for f, b, p in zip(d["stage_forward_s"], d["stage_backward_s"], d["p2p_s"])])
    assert res.makespan_s == pytest.approx(sum(T) + (R - 1) * max(T), rel=1e-12)
    # post-step: one rank per stage and role, no replicas: the slowest optimizer step
    _, pieces = pipeline.model_pieces(SMALL, 2)
    post = max([c.optimizer_time("A40", c.pipeline_stage_params(pieces[i], i == 0, i == 1)) for i in range(2)]
               + [c.optimizer_time("V100-16GB", 4 * 8 * SMALL.expert_params())])
    assert res.step_time_s - res.makespan_s == pytest.approx(post, rel=1e-12)
    # one more microbatch of the same size costs the slowest stage, once
    plan7 = even_plan(8, 8, 1, 1, attention_gpu="A40", expert_gpu="V100-16GB", num_microbatches=R + 1,
                      pipeline_stages=2)
    assert simulate_plan(plan7, c, cl, R + 1).makespan_s - res.makespan_s == pytest.approx(max(T), rel=1e-9)


def test_memory_per_stage_by_hand():
    """P = 4 stages, R = 8: stage i keeps 4 - i microbatches. An expert rank of stage 0 holds the
    same experts as one of stage 3 plus the routed tokens of 3 more microbatches (keep-inputs:
    h x 2 bytes a token); attention ranks of the middle stages (2 pieces each) differ by one
    microbatch's checkpointed inputs; the first stage (embedding, 4 microbatches) holds more than
    the last (output layer and logits of a 1000-word vocabulary, 1 microbatch)."""
    cl = Cluster.load("o2")  # 4 A40 + 8 V100-16GB
    c = cost()
    a, x = cl.ranks_of("A40"), cl.ranks_of("V100-16GB")
    R, B = 8, 32
    lay = even_layout(SMALL, cl.gpu_types(), a, x, 1, 4, R)
    rows = pipeline_memory(lay, c, B)
    assert [r["alive"] for r in rows] == [4, 3, 2, 1]
    t = B * S / (1 * 1 * R)  # one attention rank per stage
    tpe = 1 * t * 2 / 8
    assert all(r["expert"]["experts"] == 2 * 4 for r in rows)  # 2 layers x 4 of 8 experts on each of 2 ranks
    assert rows[0]["expert"]["bytes"] - rows[3]["expert"]["bytes"] == pytest.approx(8 * tpe * 1024 * 2 * 3)
    assert rows[1]["attention"]["bytes"] - rows[2]["attention"]["bytes"] == pytest.approx(2 * t * 1024 * 2 * 1)
    assert rows[0]["attention"]["bytes"] > rows[3]["attention"]["bytes"]
    assert memory_shortfall(lay, c, B) is None
    # far too many tokens in one microbatch (R = 1: every stage keeps one): named, with the stage and
    # the role; the last stage is furthest over, as it also holds the microbatch's fp32 logits
    short = memory_shortfall(even_layout(SMALL, cl.gpu_types(), a, x, 1, 4, 1), c, 4096)
    assert short is not None and short[0] > 0
    assert "pipeline stage 3 of 4: an attention rank (A40)" in short[1] and "1 live microbatch" in short[1]


def test_search_layout_is_the_plan_it_builds():
    """The search prices even_layout without building the plan; the plan it returns must price
    alike (a model whose dense layer ends stage 0 of 2; attention TP 2; two ZP groups)."""
    m = SMALL.replace(moe_layer_freq=[1, 1, 1, 0, 1, 1, 1, 1])  # dense model layer 3 ends stage 0 of 2
    cl = Cluster.from_gpu_types("4+4", ["A40"] * 4 + ["V100-16GB"] * 4)
    types = cl.gpu_types()
    c = cost(m)
    k = [0] * m.num_moe_layers
    for G, tp in ((1, 2), (2, 1)):
        lay = even_layout(m, types, [0, 1, 2, 3], [4, 5, 6, 7], G, 2, 4, tp)
        plan = build_plan(m, types, [0, 1, 2, 3], [4, 5, 6, 7], G, 4, k, "distep", attention_tp=tp, pipeline_stages=2)
        plan.validate(world_size=8)
        assert lay.pieces == layout_of_plan(plan).pieces == [[(0, 0), (1, 0), (2, 1)],
                                                             [(3, 0), (4, 0), (5, 0), (6, 0), (7, 0)]]
        assert price(lay, c, cl, 16).step_time_s == pytest.approx(simulate_plan(plan, c, cl, 16).step_time_s,
                                                                  rel=1e-12)
        for gi in range(G):  # every layer's experts on its own stage's expert ranks, split evenly
            for s in range(2):
                exp = plan.stage_ranks(gi, s)[1]
                for l in plan.stage_moe_layers(s):
                    assert sorted(plan.groups[gi].placement[l]) == sorted(exp)
                    assert sorted(e for es in plan.groups[gi].placement[l].values() for e in es) == list(range(8))


def test_lower_bound_never_exceeds_the_price():
    m = ModelConfig.load("mixtral-8x7b")
    cl = Cluster.load("h100x16-v100x16")
    c = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(4096))
    types = cl.gpu_types()
    checked = 0
    for cand in candidates(cl, m, 64, 32, 4096, pipeline_stages=(2, 4, 8))[::7]:
        M, N = cand.stage_shape
        lay = even_layout(m, types, cand.attention_ranks, cand.expert_ranks, cand.G, cand.P, cand.R, cand.tp)
        t = 64 * 4096 / (cand.G * M * cand.R)
        lb = pipeline.lower_bound(c, {types[cand.attention_ranks[0]]}, {types[cand.expert_ranks[0]]}, t, M * t * 2 / 8,
                                  32 * -(-8 // N), cand.P, cand.R, cand.tp)
        assert 0 < lb <= price(lay, c, cl, 64).step_time_s
        checked += 1
    assert checked >= 5


# ---------------------------------------------------------------- refusals
def test_no_distep_task_lists_with_pipeline_stages():
    """DistEP in stages is the 1F1B model's (zebra's task lists there: test_zebra_stages_sim.py)."""
    plan = even_plan(8, 8, 1, 1, attention_gpu="A40", expert_gpu="V100-16GB", num_microbatches=2, pipeline_stages=2)
    cl = Cluster.from_gpu_types("t", plan.gpu_types)
    c = cost()
    with pytest.raises(PlanError, match="no task lists to trace"):
        simulate_plan(plan, c, cl, 2, keep_trace=True)
    with pytest.raises(PlanError, match="pipeline_stages=2"):
        build_problem(plan, c, cl, 2)
    with pytest.raises(PlanError, match="pipeline_stages=2"):
        rank_task_times(plan, c, cl, 2, rank=0)
    assert simulate_plan(plan, c, cl, 2).step_time_s > 0
    with pytest.raises(PlanError, match="Asym-EA.*attention_tp=2"):
        build_plan(SMALL, ["A40"] * 4 + ["V100-16GB"] * 2, [0, 1, 2, 3], [4, 5], 1, 2, [1] * 8, "zebra",
                   attention_tp=2, pipeline_stages=2)


# ---------------------------------------------------------------- the search
def test_search_needs_pipeline_stages_for_mixtral_on_h100_v100():
    """Mixtral-8x7B, 4K tokens, 64 sequences on 16 H100 + 16 V100-32GB: no one-stage plan fits
    (the V100s cannot hold the 256 experts' share, the dense model and activations do not fit next
    to them either way); with pipeline stages the search finds a plan (zebra in waves of
    microbatches with Asym-EA inside each stage: H100 attention ranks holding some experts, which
    beats DistEP's 1F1B and zebra without Asym-EA there) that validates and prices as it said."""
    m = ModelConfig.load("mixtral-8x7b")
    cl = Cluster.load("h100x16-v100x16")
    assert search(m, cl, 4096, 64, baselines=False, pipeline_stages=(1,)).plan is None
    res = search(m, cl, 4096, 64, baselines=False)
    plan, pick = res.plan, res.by_name()[PICK]
    assert plan is not None and plan.pipeline_stages > 1 and pick.detail["pipeline_stages"] == plan.pipeline_stages
    assert plan.schedule == "zebra" and plan.zebra_waves > 1 and plan.experts_on_attention_ranks_any()
    assert "Asym-EA (optimal) inside each stage" in plan.meta["assignment"]
    plan.validate(world_size=cl.world_size, known_gpu_types=known_gpu_types())
    for gi in range(len(plan.groups)):  # each stage its own ranks, one GPU type per role
        ranks = [r for s in range(plan.pipeline_stages) for r in plan.stage_members(gi, s)]
        assert len(ranks) == len(set(ranks))
        for s in range(plan.pipeline_stages):
            att, exp = plan.stage_ranks(gi, s)
            assert len({plan.gpu_types[r] for r in att}) == len({plan.gpu_types[r] for r in exp}) == 1
    c = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(4096, expert_recompute=plan.expert_recompute))
    again = simulate_plan(plan, c, cl, 64)
    assert again.step_time_s == pytest.approx(pick.step_time_s, rel=1e-12)
    assert memory_shortfall(layout_of_plan(plan), c, 64, zebra=True) is None
    assert pick.detail["zebra_waves"] == plan.zebra_waves
    even = build_plan(m, plan.gpu_types, plan.attention_ranks, [r for g in plan.groups for r in g.expert_ranks],
                      len(plan.groups), plan.num_microbatches, [0] * 32, "zebra", pipeline_stages=plan.pipeline_stages,
                      zebra_waves=plan.zebra_waves)  # the same stages without Asym-EA
    distep = dataclasses.replace(even, schedule="distep", zebra_waves=1)  # and DistEP's 1F1B on them
    for other in (even, distep):
        assert simulate_plan(other, c, cl, 64).step_time_s > pick.step_time_s
    # every pipeline size alone: a plan of that size, or none; never a one-stage plan
    for P in (2, 4, 8):
        r = search(m, cl, 4096, 64, baselines=False, pipeline_stages=(P,))
        if r.plan is not None:
            assert r.plan.pipeline_stages == P
            r.plan.validate(world_size=cl.world_size)
            assert r.by_name()[PICK].step_time_s >= pick.step_time_s * (1 - 1e-12)
        for name, p in r.by_name().items():
            if name in ("DistEP", "Zebra (no Asym-EA)"):
                assert not p.fits and "not searched with pipeline_stages" in p.detail["reason"]


def test_cli_pipeline_stages(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["--cluster", "h100x16-v100x16", "--model", "mixtral-8x7b", "--seq-len", "4096", "--global-batch", "64"]
    assert main([*args, "--pipeline-stages", "4", "--json", "-o", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["strategies"][PICK]["detail"]["pipeline_stages"] == 4
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan
    plan = HeteroPlan.load(out)
    assert plan.pipeline_stages == 4 and plan.schedule in ("distep", "zebra")
    plan.validate(world_size=32)
    assert main([*args, "--pipeline-stages", "4"]) == 0
    assert "pipeline stages P=4" in capsys.readouterr().out
    assert main([*args, "--pipeline-stages", "3"]) == 2
    assert "--pipeline-stages 3: the search tries [1, 2, 4, 8]" in capsys.readouterr().err
    # --even keeps its meaning: P stages of M + N ranks, 1 by default
    even = tmp_path / "e.json"
    base = ["--even", "--attention-ranks", "2", "--expert-ranks", "1", "--model", "tiny", "-o", str(even)]
    assert main(base) == 0 and HeteroPlan.load(even).pipeline_stages == 1
    assert main([*base, "--pipeline-stages", "2"]) == 0
    e = HeteroPlan.load(even)
    assert e.pipeline_stages == 2 and e.world_size == 6
