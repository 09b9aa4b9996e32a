"""The cost model prices attention from its real projections, other MLP activations, sliding
windows, MTP layers, selective recomputation and the network floor (issue 42 items 1 and 5):
hand-checked FLOPs and counts, and the structure of the stage times."""
import math

import pytest

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.baselines import BaselineResult, distinct_nodes, network_limit, roofline
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import (
    CostModel,
    Program,
    TrainSettings,
    attention_core_flops,
    attention_linear_flops,
    mlp_flops,
)
from megatron_hetermoe.planner.profiles import load_profiles

SMALL = dict(name="s", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, moe_ffn_hidden_size=32,
             num_experts=8, moe_router_topk=2, vocab_size=256, seq_length=8)


def test_attention_flops_from_the_projections():
    """2 FLOPs per MAC of every projection; the core a query's s/2 keys x (qk + v channels) per head."""
    mha = ModelConfig(**SMALL)
    assert attention_linear_flops(mha, 1, router=False) == 2 * 4 * 64 * 64  # QKV + proj, 4 h^2 MACs
    assert attention_linear_flops(mha, 1) == 2 * (4 * 64 * 64 + 64 * 8)  # + the router
    assert attention_core_flops(mha, 1, 8) == 2 * 8 * 64  # the paper's 2 s h
    gqa = mha.replace(kv_channels=32, num_query_groups=2)  # Qwen3's shape: 4 x 32 = 128 != 64
    assert attention_linear_flops(gqa, 1, router=False) == 2 * (64 * (128 + 2 * 2 * 32) + 128 * 64)
    assert attention_core_flops(gqa, 1, 8) == 8 * 4 * (32 + 32)
    mla = mha.replace(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                      qk_pos_emb_head_dim=4, v_head_dim=8)
    macs = 64 * 24 + 24 * 4 * 12 + 64 * (16 + 4) + 16 * 4 * (8 + 8) + 4 * 8 * 64
    assert attention_linear_flops(mla, 1, router=False) == 2 * macs
    assert attention_core_flops(mla, 1, 8) == 8 * 4 * (12 + 8)  # queries and keys 12 wide, values 8


def test_window_fraction_by_hand():
    """s = 8, window (2, 0): query i meets min(i, 2) + 1 keys, 1+2+3+3+3+3+3+3 = 21 of the full 36;
    --window-attn-skip-freq 2 windows layer numbers 1 and 3 of 4 (Megatron's n % 2 != 0)."""
    m = ModelConfig(**SMALL, window_size=(2, 0))
    assert m.window_fraction(8) == pytest.approx(21 / 36, rel=1e-12)
    assert m.replace(window_attn_skip_freq=2).window_fraction(8) == pytest.approx((2 * 21 / 36 + 2) / 4, rel=1e-12)
    assert m.replace(window_attn_skip_freq=[0, 0, 0, 1]).window_fraction(8) == pytest.approx((21 / 36 + 3) / 4)
    assert m.replace(window_size=(7, 0)).window_fraction(8) == 1.0  # the window covers the sequence
    assert attention_core_flops(m, 1, 8) == pytest.approx(attention_core_flops(ModelConfig(**SMALL), 1, 8) * 21 / 36)
    # an unfused core computes the whole square whatever the mask
    assert attention_core_flops(m, 1, 8, full=True) == attention_core_flops(ModelConfig(**SMALL), 1, 8)


def test_mlp_activations():
    """Gated MLPs (SwiGLU, quick-GeGLU) run three h x f GEMMs, the others two."""
    assert mlp_flops(64, 32, 1) == 6 * 64 * 32 and mlp_flops(64, 32, 1, gated=False) == 4 * 64 * 32
    big = {**SMALL, "hidden_size": 4096, "moe_ffn_hidden_size": 14336}  # compute-bound GEMMs on 1M tokens
    base = CostModel(ModelConfig(**big), load_profiles(["A40"]), TrainSettings(8, False))
    for act, gated in (("swiglu", True), ("quick-geglu", True), ("gelu", False), ("squared-relu", False)):
        m = ModelConfig(**SMALL, mlp_activation=act)
        assert m.expert_params() == (3 if gated else 2) * 64 * 32
        c = CostModel(ModelConfig(**big, mlp_activation=act), load_profiles(["A40"]), TrainSettings(8, False))
        ratio = c.expert_time("A40", 1e6) / base.expert_time("A40", 1e6)  # compute-bound: the FLOP ratio
        assert ratio == pytest.approx(1.0 if gated else 2 / 3, rel=1e-3)


def test_mtp_layers_are_moe_layers_after_the_decoder_with_their_projection_and_head():
    """An MTP layer of a model whose last layer is MoE is one more MoE layer (stage) for the plan and
    the cost model; its stage adds MTP's entry (norms and the 2h -> h projection); the head stage
    runs the output layer and loss once more."""
    m = ModelConfig(**SMALL, mtp_num_layers=1)
    c = CostModel(m, load_profiles(["A40"]), TrainSettings(8, False))
    plain = CostModel(ModelConfig(**SMALL), load_profiles(["A40"]), TrainSettings(8, False))
    assert (m.planned_num_moe_layers, c.num_layers, c.mtp_in_stage, c.heads) == (5, 5, [0, 0, 0, 0, 1, 0], 2)
    t, h = 1000.0, 64
    for bwd in (False, True):
        assert c.stage_time("A40", 4, t, bwd) == pytest.approx(c.stage_time("A40", 3, t, bwd)
                                                               + c.mtp_entry_time("A40", t, bwd), rel=1e-12)
        combine = c.elementwise_time("A40", (2.0 if bwd else 1.0) * t * h * 2 * (2 + 2))
        assert c.stage_time("A40", 5, t, bwd) == pytest.approx(combine + 2 * c.head_time("A40", t, bwd), rel=1e-12)
        assert plain.stage_time("A40", 4, t, bwd) == pytest.approx(combine + plain.head_time("A40", t, bwd), rel=1e-12)
    # MTP's projection (2h -> h): 2 x 2h x h FLOPs per token at the GEMM rate (compute-bound at h = 4096)
    p = c.profile("A40")
    expect = 2 * 8192 * 4096 * 1e6 / (p.peak_fp16_tflops * 1e12 * p.gemm_efficiency) + 2 * p.launch_overhead_us * 1e-6
    assert c.linear_time("A40", 8192, 4096, 1e6) == pytest.approx(expect, rel=1e-12)
    # a dense last layer makes the MTP layer dense: a dense layer and MTP's entry in the head stage
    d = CostModel(ModelConfig(**SMALL, moe_layer_freq="[1]*3+[0]", mtp_num_layers=1), load_profiles(["A40"]),
                  TrainSettings(8, False))
    assert (d.num_layers, d.dense_in_stage, d.mtp_in_stage) == (3, [0, 0, 0, 2], [0, 0, 0, 1])


def test_selective_recompute_re_runs_the_core_and_keeps_no_scores():
    """--recompute-activations (selective core_attn): backward re-runs the attention core's forward;
    with unfused attention the scores (5 heads x seq per token) are not kept."""
    m = ModelConfig(**SMALL).replace(seq_length=4096)
    prof = load_profiles(["A40"])
    fp32 = Program("fp32", "unfused", "none")
    off = CostModel(m, prof, TrainSettings(4096, program=fp32))
    sel = CostModel(m, prof, TrainSettings(4096, program=fp32, recompute_modules=frozenset({"core_attn"})))
    fwd = off.attention_time("A40", 4096, False, router=False)
    core, lin = 2 * attention_core_flops(m, 4096, 4096, full=True), attention_linear_flops(m, 4096, False)
    assert sel.attention_time("A40", 4096, True, router=False) == pytest.approx(
        off.attention_time("A40", 4096, True, router=False) + fwd * core / (lin + core), rel=1e-12)
    assert off.layer_activation_bytes_per_token() - sel.layer_activation_bytes_per_token() == 5 * 4 * 4096 * 4 / 2
    # the generalized 34 h: 3 h + 2 (q + k + v widths) + 2 x the projection's input + 23 h = 34 h for MHA
    assert CostModel(m, prof, TrainSettings(4096)).layer_activation_bytes_per_token() == 34 * 64
    with pytest.raises(ValueError, match="recompute_modules \\['moe'\\]"):
        TrainSettings(8, recompute_modules=frozenset({"moe"}))


def test_distinct_nodes_by_hand():
    """8 experts on 2 nodes of 4, top-2: a node is missed with C(4,2)/C(8,2) = 6/28, so 2 (1 - 6/28)
    nodes are reached; top-1 of 4 groups of 2 (2 groups a node): 2 (1 - C(2,1)/C(4,1)) = 1."""
    assert distinct_nodes(8, 2, [4, 4]) == pytest.approx(2 * (1 - 6 / 28), rel=1e-12)
    assert distinct_nodes(8, 2, [4, 4], groups=4, group_topk=1) == pytest.approx(1.0, rel=1e-12)
    assert distinct_nodes(8, 2, [8]) == 1.0 and distinct_nodes(8, 8, [1] * 8) == pytest.approx(8.0)


def test_network_floor_by_hand():
    """One node of 8 H100 (attention) and one of 8 A100 (experts), a model whose experts cannot all
    sit on the H100 node, per-sequence compute set by hand: network(f) = (1 - f) x 2 transfers x
    tokens x MoE layers x 1 node x 2 h bytes / (8 x 25 GB/s); attention(f) = 64 x (a + f e_H100) / 8;
    experts(f) = (1 - f) x 64 / (8 / e_A100); the floor is least where attention meets the
    network's line: f* = (net0 - att0) / (att1 + net0), below f_max = the H100 node's memory over
    the experts' copy."""
    cl = Cluster.of("h100-a100", {"H100": 8, "A100-80GB": 8}, nic_gbps=200.0)
    m = ModelConfig(name="big", num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
                    moe_ffn_hidden_size=14336, num_experts=16, seq_length=4096)
    cost = CostModel(m, load_profiles(["H100", "A100-80GB"]), TrainSettings(4096))
    compute = BaselineResult("Physical limit", 0.1, 1.0, {}, {"attention_s_per_seq": {"H100": 0.025, "A100-80GB": 1.0},
                                                             "expert_s_per_seq": {"H100": 0.125, "A100-80GB": 0.0625}})
    h100, a100 = list(range(8)), list(range(8, 16))
    net = network_limit(cost, cl, 64, [(h100, a100, 1, 1)], compute)
    f_max = 8 * cost.profile("H100").usable_memory_bytes / (32 * 16 * m.expert_params() * 18.0)
    net0 = 2 * 64 * 4096 * 32 * 1.0 * 4096 * 2 / (8 * 200 / 8 * 1e9)
    att0, att1 = 64 * 0.025 / 8, 64 * 0.125 / 8  # 0.2, 1.0 s (the experts' 64 / (8 / 0.0625) = 0.5 s)
    f = (net0 - att0) / (att1 + net0)
    assert 0 < f < f_max < 1
    assert net.step_time_s == pytest.approx(att0 + f * att1, rel=1e-12)
    assert net.detail["routed_on_attention"] == pytest.approx(f, rel=1e-12)
    assert net.detail["network_s"] == pytest.approx((1 - f) * net0, rel=1e-12) and net.detail["experts_s"] < \
        net.step_time_s
    assert net.detail["expert_nodes_per_stage"] == 1 and net.detail["distinct_nodes_per_token"] == 1.0
    # the least over the layouts counts; two groups on the same nodes move the same bytes
    assert network_limit(cost, cl, 64, [(h100, a100, 2, 1), (h100, a100, 1, 1)], compute).step_time_s == \
        net.step_time_s
    # experts over two nodes, top-2 of 16 (8 a node): 2 (1 - C(8,2)/C(16,2)) nodes per token
    cl2 = Cluster.of("h100-a100x2", {"H100": 8, "A100-80GB": 16}, nic_gbps=200.0)
    net2 = network_limit(cost, cl2, 64, [(h100, list(range(8, 24)), 1, 1)], compute)
    assert net2.detail["distinct_nodes_per_token"] == pytest.approx(2 * (1 - 28 / 120), rel=1e-12)
    roof = roofline(compute, net)
    assert roof.step_time_s == net.step_time_s and roof.detail["bound_by"] in ("network", "attention ranks")
    assert math.isfinite(roof.tokens_per_s)
    assert network_limit(cost, cl, 64, [], compute).step_time_s == 0.0  # no layout fits: no floor
    assert roofline(compute, network_limit(cost, cl, 64, [], compute)).step_time_s == 0.1


def test_the_roofline_bounds_every_hetermoe_row():
    """moe-64l-256e on 64 H100 + 128 A100, one stage: the network floor is above zero (a stage's
    experts on two nodes, at most a third of them on an attention node), and no HeterMoE row's
    simulated step beats the roofline."""
    from megatron_hetermoe.planner.search import LIMIT_ROWS, search

    res = search(ModelConfig.load("moe-64l-256e"), Cluster.load("mixed-h100-a100"), 4096, 256,
                 pipeline_stages=(1,)).by_name()
    roof, net = res[LIMIT_ROWS[2]], res[LIMIT_ROWS[1]]
    assert net.step_time_s > 0
    for name, p in res.items():
        if p.fits and name not in LIMIT_ROWS:
            assert p.ratio_to_limit <= 1.0 + 1e-9, (name, p.ratio_to_limit)
            if not name.startswith(("EP", "Megatron", "Hetero PP")):
                assert p.step_time_s >= roof.step_time_s, name
