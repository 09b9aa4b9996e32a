"""Tensor parallelism on attention members (plan.attention_tp): pricing by hand, the search's
TP candidates, the Megatron EP baseline with TP/PP, and a real-size plan (Mixtral 8x7B)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.planner.baselines import simulate_ep, simulate_megatron_ep
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.search import (
    DISTEP,
    PICK,
    ZEBRA,
    ZEBRA_GREEDY,
    ZEBRA_NO_EA,
    candidates,
    search,
)
from megatron_hetermoe.planner.simulator import build_problem, simulate_plan

# A hand-sized model: h=1024, 8 heads, 4 MoE layers of 8 experts, vocab 1000.
SMALL = ModelConfig(name="tp-small", num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=2048,
                    moe_ffn_hidden_size=512, num_experts=8, moe_router_topk=2, vocab_size=1000, seq_length=1024)


def cost(model=SMALL, ckpt=True, dist=False, gpus=("H100", "V100-32GB")):
    return CostModel(model, load_profiles(gpus), TrainSettings(model.seq_length, ckpt, distributed_optimizer=dist))


def test_tp_collective_time_by_hand():
    # H100: intra_node_gbs 380, link_latency_us 15. A rank holding 2048 tokens (its slice) of
    # h=1024 in fp16 at tp=4 moves (4-1) x 2048 x 1024 x 2 = 12_582_912 bytes per all-gather:
    # 15e-6 + 12_582_912 / 380e9 = 15e-6 + 33.1129e-6 = 48.1129e-6 s.
    c = cost()
    assert c.tp_collective_time("H100", 2048, 4) == pytest.approx(15e-6 + 12_582_912 / 380e9, rel=1e-12)
    assert c.tp_collective_time("H100", 2048, 1) == 0.0
    # collectives per forward: stage 0 = embedding RS + attention AG/RS = 3; middle = 2; head stage = 1
    L = SMALL.num_moe_layers
    assert [c.tp_collectives(s) for s in range(L + 1)] == [3, 2, 2, 2, 1]
    one = c.tp_collective_time("H100", 2048, 4)
    assert c.tp_comm_time("H100", 1, 2048, 4) == pytest.approx(2 * one)
    # backward: the same volumes, twice with activation checkpointing (the re-run forward gathers again)
    assert c.tp_comm_time("H100", 1, 2048, 4, backward=True) == pytest.approx(4 * one)
    assert cost(ckpt=False).tp_comm_time("H100", 1, 2048, 4, backward=True) == pytest.approx(2 * one)
    # the stage time of a TP rank: the same stage on its slice, plus the collectives
    assert c.stage_time("H100", 1, 2048, False, 4) == pytest.approx(c.stage_time("H100", 1, 2048) + 2 * one)


def test_tp_memory_per_rank_by_hand():
    c = cost()
    h, E, V, L = 1024, 8, 1000, 4
    # non-expert params: 2 V h (embedding + output) + L (4 h^2 + 2 h + h E) + h (final norm)
    total = 2 * V * h + L * (4 * h * h + 2 * h + h * E) + h
    assert SMALL.non_expert_params() == total == 18_867_200
    rep = L * (2 * h + h * E) + h  # norms, routers, final norm: replicated over the TP group
    assert c.tp_replicated_params() == rep == 41_984
    assert c.non_expert_params_per_rank(4) == pytest.approx((total - rep) / 4 + rep) == 4_748_288
    assert c.non_expert_state_bytes(4) == pytest.approx(4_748_288 * 18)
    # attention rank bytes: the state shrinks by (total - per rank) x 18, the working set grows by
    # the all-gathered sequence (tp-1) x tokens x h x 2
    t = 512
    diff = c.attention_rank_bytes(t, 2) - c.attention_rank_bytes(t, 2, tp=4)
    assert diff == pytest.approx((total - 4_748_288) * 18 - 3 * t * h * 2)
    # distributed optimizer: 6 + 12/dp bytes per parameter (mixed precision)
    d = cost(dist=True)
    assert d.state_bytes_per_param(4) == 9.0 and d.state_bytes_per_param(1) == 18.0
    assert d.expert_state_bytes(2) == SMALL.expert_params() * 12.0


def test_simulated_tp_plan_prices_the_collectives_and_shards():
    cl = Cluster.from_gpu_types("t", ["H100"] * 4 + ["V100-32GB"] * 4)
    c = cost()
    B = 8
    p1 = even_plan(SMALL.num_layers, 8, 4, 4, attention_gpu="H100", expert_gpu="V100-32GB", schedule="zebra",
                   num_microbatches=2)
    p4 = even_plan(SMALL.num_layers, 8, 4, 4, attention_gpu="H100", expert_gpu="V100-32GB", schedule="zebra",
                   num_microbatches=2, attention_tp=4)
    a, b = build_problem(p1, c, cl, B), build_problem(p4, c, cl, B)
    t_mb = B * SMALL.seq_length / (4 * 2)  # each rank's slice per microbatch: the same in both
    for i, (tk, d1, d4) in enumerate(zip(a.tasks[0], a.dur[0], b.dur[0])):
        if tk.kind in ("A_F", "A_B"):
            assert d4 - d1 == pytest.approx(c.tp_comm_time("H100", tk.layer, t_mb, 4, tk.kind == "A_B"))
    assert a.coll_dur == b.coll_dur  # dispatch volume unchanged: every TP rank sends its own slice
    assert b.post_step[0] < a.post_step[0]  # a quarter of the dense gradients and optimizer
    assert simulate_plan(p4, c, cl, B).step_time_s > 0


def test_tp_candidates_place_no_experts_on_attention_ranks():
    cl = Cluster.load("h100x16-v100x16")
    m = ModelConfig.load("dsv2-lite")
    cands = candidates(cl, m, 64, 8, 4096)
    assert {c.tp for c in cands} == {1, 2, 4, 8}
    for c in cands:
        M = len(c.attention_ranks) // c.G
        assert M % c.tp == 0
        nodes = cl.node_of()
        assert all(len({nodes[r] for r in c.attention_ranks[i:i + c.tp]}) == 1
                   for i in range(0, len(c.attention_ranks), c.tp))
    res = search(m, cl, 4096, 64, attention_tp=(2,))
    for p in res.predictions:
        if p.fits and "attention_tp" in p.detail:
            assert p.detail["attention_tp"] == 2 and not any(p.detail["experts_on_attention_per_layer"])
    if res.plan is not None:
        assert res.plan.attention_tp == 2 and not res.plan.experts_on_attention_ranks_any()
        res.plan.validate()


def test_megatron_ep_tp1_pp1_is_simulate_ep():
    for name, model, B in (("o1", "d1", 48), ("mini-2a40-2v100", "tiny", 8)):
        cl = Cluster.load(name)
        m = ModelConfig.load(model)
        c = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(4096))
        a, b = simulate_megatron_ep(c, cl, B), simulate_ep(c, cl, B)
        assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)


def test_mixtral_plan_on_h100_v100_fits_with_attention_tp():
    cl = Cluster.load("h100x16-v100x16")
    m = ModelConfig.load("mixtral-8x7b")
    # one pipeline stage: this test is about TP (pipeline stages: test_pipeline_stages_planner.py)
    res = search(m, cl, 4096, 128, distributed_optimizer=True, pipeline_stages=(1,))
    plan = res.plan
    assert plan is not None and plan.attention_tp > 1
    plan.validate(world_size=32)
    assert not plan.experts_on_attention_ranks_any()
    pick = res.by_name()[PICK]
    assert pick.fits and pick.detail["attention_tp"] == plan.attention_tp
    # memory of the plan's ranks, as the search priced it
    c = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(4096, distributed_optimizer=True,
                                                                        expert_recompute=plan.expert_recompute))
    G, M = len(plan.groups), len(plan.groups[0].attention_ranks)
    R, tp = plan.num_microbatches, plan.attention_tp
    t_mb = 128 * 4096 / (G * M * R)
    alive = R if plan.schedule == "zebra" else 1
    a_gpu, x_gpu = plan.gpu_types[plan.groups[0].attention_ranks[0]], plan.gpu_types[plan.groups[0].expert_ranks[0]]
    assert c.attention_rank_bytes(t_mb, alive, tp=tp, dp=G * M // tp) <= c.profile(a_gpu).usable_memory_bytes
    tpe = M * t_mb * 2 / 8
    held = max(len(plan.groups[0].placement[l].get(r, [])) for l in range(plan.num_layers)
               for r in plan.groups[0].expert_ranks) * plan.num_layers
    assert (held * c.per_expert_bytes(tpe, alive, G) + c.expert_working_bytes(tpe)
            <= c.profile(x_gpu).usable_memory_bytes)
    # without TP no zebra plan fits (the dense model on one V100-32GB with 18 B/param... and its
    # activations): TP is what makes this batch plannable for zebra (one-stage DistEP, one microbatch
    # alive, fits without it, slower)
    res1 = search(m, cl, 4096, 128, distributed_optimizer=True, attention_tp=(1,), baselines=False,
                  pipeline_stages=(1,)).by_name()
    assert not any(res1[n].fits for n in (ZEBRA, ZEBRA_GREEDY, ZEBRA_NO_EA))
    assert res1[DISTEP].fits and res1[DISTEP].step_time_s > pick.step_time_s


@settings(max_examples=15, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), members=st.integers(1, 2), n=st.integers(1, 4), groups=st.integers(1, 2),
       R=st.sampled_from([1, 2]))
def test_even_tp_plans_place_every_expert_once_and_simulate(tp, members, n, groups, R):
    m = SMALL
    plan = even_plan(m.num_layers, m.num_experts, members * tp, n, groups, attention_gpu="H100",
                     expert_gpu="V100-32GB", num_microbatches=R, schedule="zebra", attention_tp=tp)
    for g in plan.groups:
        for pl in g.placement:
            held = sorted(e for r, es in pl.items() for e in es)
            assert held == list(range(m.num_experts))
            assert not any(pl.get(r) for r in g.attention_ranks)
    cl = Cluster.from_gpu_types("t", plan.gpu_types)
    B = plan.num_attention_members * R
    res = simulate_plan(plan, cost(), cl, B)
    assert res.step_time_s > 0
