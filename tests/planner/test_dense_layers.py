"""Dense layers and shared experts in the planner (issue 27 item 2): ModelConfig's moe_layer_freq and
moe_shared_expert_intermediate_size, the cost model's price of a dense layer and of a shared expert
(hand-checked FLOPs), the memory model, the baselines pricing the same model, and plans that carry
dense_layers."""
import dataclasses

import pytest

from megatron_hetermoe.config import ModelConfig, ModelConfigError
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan
from megatron_hetermoe.planner.baselines import (
    PPStage,
    _ep_group_mb_time,
    pp_stage_bytes,
    pp_stage_params,
    pp_stage_time,
)
from megatron_hetermoe.planner.cli_plan import main
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import BYTES_PER_PARAM_STATE, CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profile, load_profiles
from megatron_hetermoe.planner.search import search
from megatron_hetermoe.planner.simulator import rank_task_times, simulate_plan

TOKENS = 1000


def tiny_dense() -> ModelConfig:
    """configs/models/tiny-dense.yaml: h=64, 4 heads, s=32, dense first layer (F=256), 2 MoE layers
    of 4 experts (f=64, top-2) with a shared expert of S=128, V=256."""
    return ModelConfig.load("tiny-dense")


def flop_cost(model: ModelConfig, ckpt: bool = False) -> CostModel:
    """A GPU of exactly 1 TFLOP/s on every GEMM and attention core, no launch overhead and
    (practically) infinite memory bandwidth: a time is its FLOPs / 1e12."""
    p = dataclasses.replace(load_profile("A40"), peak_fp16_tflops=1.0, gemm_efficiency=1.0,
                            attention_core_efficiency=1.0, memory_bandwidth_gbs=1e15, launch_overhead_us=0.0)
    return CostModel(model, {"A40": p}, TrainSettings(model.seq_length, ckpt))


# ---------------------------------------------------------------- ModelConfig
def test_yaml_and_properties():
    m = tiny_dense()
    assert m.num_layers == 3 and m.moe_layer_freq == [0, 1, 1]
    assert (m.dense_layers, m.moe_layer_ids, m.num_moe_layers) == ([0], [1, 2], 2)
    ds = ModelConfig.load("dsv2-lite")  # the list expression, as DeepSeek's recipes write it
    assert ds.moe_layer_freq == [0] + [1] * 26 and ds.dense_layers == [0] and ds.num_moe_layers == 26
    d1 = ModelConfig.load("d1")  # every existing config: every layer MoE, no shared expert
    assert (d1.moe_layer_freq, d1.dense_layers, d1.num_moe_layers, d1.moe_shared_expert_intermediate_size) == \
        (1, [], 8, None)
    freq2 = d1.replace(moe_layer_freq="2")  # Megatron's int, as a string: layer i is MoE when i % 2 == 0
    assert freq2.moe_layer_freq == 2 and freq2.dense_layers == [1, 3, 5, 7]
    # the string and list forms of one pattern are one config (and hash alike)
    assert m.replace(moe_layer_freq="([0]+[1]*2)") == m and hash(m.replace(moe_layer_freq="([0]+[1]*2)")) == hash(m)


def test_non_expert_params_by_hand():
    """tiny-dense, h=64, V=256, E=4, F=256, S=128:
    attention + 2 norms per layer: 4*64^2 + 2*64 = 16512;
    MoE layer: 16512 + router 64*4 + shared 3*64*128 = 16512 + 256 + 24576 = 41344;
    dense layer: 16512 + 3*64*256 = 16512 + 49152 = 65664;
    model: embedding + output 2*256*64 = 32768, final norm 64: 32768 + 2*41344 + 65664 + 64 = 181184."""
    m = tiny_dense()
    assert m.non_expert_params() == 181184
    c = flop_cost(m)
    assert sum(c.stage_params(s) for s in range(3)) + 2 * 256 * 64 + 64 == 181184
    assert c.dense_in_stage == [1, 0, 0]  # the dense first layer runs before MoE layer 0's attention


@pytest.mark.parametrize("freq, words", [
    (0, "must be >= 1"),
    ("[0]*3", "leaves no MoE layer"),
    ([1, 1], "need 3 entries"),
    ([0, 1, 2], "need 3 entries of 0 (dense) or 1 (MoE)"),
    (True, "is not an int, a list of 0/1"),
    (1.5, "is not an int, a list of 0/1"),
    ("import os", "not an int nor a list expression"),
    ("[0]+", "not an int nor a list expression"),
])
def test_bad_moe_layer_freq_names_field_value_and_fix(freq, words):
    with pytest.raises(ModelConfigError) as e:
        tiny_dense().replace(moe_layer_freq=freq)
    msg = str(e.value)
    assert "moe_layer_freq=" in msg and repr(freq) in msg and words in msg, msg
    assert "use an int N >= 1" in msg and "'([0]+[1]*2)' for a dense first layer" in msg, msg


@pytest.mark.parametrize("bad", [0, -128, True, 2.5, "128"])
def test_bad_shared_expert_size(bad):
    with pytest.raises(ModelConfigError, match=f"moe_shared_expert_intermediate_size={bad!r} must be a positive "
                                               f"integer \\(or absent: none\\)"):
        tiny_dense().replace(moe_shared_expert_intermediate_size=bad)


def test_bad_yaml_field_names_the_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: tiny-dense\nnum_layers: 2\nhidden_size: 64\n"
                 "num_attention_heads: 4\nffn_hidden_size: 128\nmoe_ffn_hidden_size: 128\nnum_experts: 4\n"
                 "moe_layer_freq: '[0, 0]'\n")
    with pytest.raises(ModelConfigError, match=r"m\.yaml: model 'tiny-dense': moe_layer_freq='\[0, 0\]'.*no MoE layer"):
        ModelConfig.load(p)


# ---------------------------------------------------------------- cost model, by hand
def test_dense_layer_priced_by_hand():
    """A dense layer, per token, forward: attention projections 8 h^2 = 8*64^2 = 32768 (no router),
    causal core 2 s h = 2*32*64 = 4096, SwiGLU MLP 6 h F = 6*64*256 = 98304; 135168 in all.
    Backward (no recompute): 2*32768 + 2.5*4096 + 2*98304 = 65536 + 10240 + 196608 = 272384.
    It runs in stage 0 (before MoE layer 0's attention): stage 0 of tiny-dense minus stage 0 of the
    same model without that layer is 1000 tokens x those FLOPs at 1 TFLOP/s; other stages are equal."""
    with_dense = flop_cost(tiny_dense())
    without = flop_cost(tiny_dense().replace(num_layers=2, moe_layer_freq=1))
    assert without.model.num_moe_layers == with_dense.model.num_moe_layers == 2
    for bwd, flops in ((False, 135168), (True, 272384)):
        diff = with_dense.stage_time("A40", 0, TOKENS, bwd) - without.stage_time("A40", 0, TOKENS, bwd)
        assert diff == pytest.approx(TOKENS * flops / 1e12, rel=1e-6)
        assert with_dense.dense_layer_time("A40", TOKENS, bwd) == pytest.approx(TOKENS * flops / 1e12, rel=1e-6)
        for s in (1, 2):
            assert with_dense.stage_time("A40", s, TOKENS, bwd) == pytest.approx(
                without.stage_time("A40", s, TOKENS, bwd))
    # with activation checkpointing the backward re-runs the forward: 272384 + 135168 per token
    ck, ck0 = flop_cost(tiny_dense(), ckpt=True), flop_cost(tiny_dense().replace(num_layers=2, moe_layer_freq=1), True)
    diff = ck.stage_time("A40", 0, TOKENS, True) - ck0.stage_time("A40", 0, TOKENS, True)
    assert diff == pytest.approx(TOKENS * (272384 + 135168) / 1e12, rel=1e-6)


def test_dense_layer_after_the_last_moe_layer_runs_before_the_head():
    """--moe-layer-freq 2 on 4 layers: MoE 0, 2; dense 1, 3. Layer 1 runs in stage 1 (before MoE
    layer 1 = model layer 2), layer 3 in stage 2 = L (before the head)."""
    m = tiny_dense().replace(num_layers=4, moe_layer_freq=2)
    c = flop_cost(m)
    assert c.dense_in_stage == [0, 1, 1]
    base = flop_cost(m.replace(num_layers=2, moe_layer_freq=1))
    for s, extra in ((0, 0), (1, 135168), (2, 135168)):
        assert c.stage_time("A40", s, TOKENS) - base.stage_time("A40", s, TOKENS) == \
            pytest.approx(TOKENS * extra / 1e12, rel=1e-6, abs=1e-15)


def test_shared_expert_priced_by_hand():
    """A shared expert (SwiGLU of S=128) takes every token: forward 6 h S = 6*64*128 = 49152 FLOPs
    per token, backward 2x = 98304. It runs in each MoE layer's stage (0 and 1), not in the head stage."""
    shared = flop_cost(tiny_dense())
    none = flop_cost(tiny_dense().replace(moe_shared_expert_intermediate_size=None))
    for bwd, flops in ((False, 49152), (True, 98304)):
        for s, n in ((0, 1), (1, 1), (2, 0)):
            diff = shared.stage_time("A40", s, TOKENS, bwd) - none.stage_time("A40", s, TOKENS, bwd)
            assert diff == pytest.approx(n * TOKENS * flops / 1e12, rel=1e-6, abs=1e-15)
    assert none.shared_expert_time("A40", TOKENS) == 0.0


def test_memory_counts_dense_and_shared_parameters():
    m = tiny_dense()
    c, plain = flop_cost(m), flop_cost(m.replace(num_layers=2, moe_layer_freq=1,
                                                 moe_shared_expert_intermediate_size=None))
    extra = 65664 + 2 * 3 * 64 * 128  # the dense layer, and two shared experts
    assert c.non_expert_state_bytes() - plain.non_expert_state_bytes() == pytest.approx(extra * BYTES_PER_PARAM_STATE)
    # and activations: more than the parameters alone (the dense layer's working set when its stage is recomputed)
    ck, ck_plain = (CostModel(x.model, x.profiles, TrainSettings(32, True)) for x in (c, plain))
    assert ck.attention_rank_bytes(TOKENS, 2) - ck_plain.attention_rank_bytes(TOKENS, 2) > \
        extra * BYTES_PER_PARAM_STATE


# ---------------------------------------------------------------- the baselines price the same model
def test_megatron_ep_and_pp_price_dense_layers_and_shared_experts():
    """EP's microbatch (bulk synchronous, one GPU type) and a PP stage grow by exactly the dense
    layer's and the shared experts' forward + backward; PP's stage holds their parameters."""
    cl = Cluster.load("a40x12")
    m = tiny_dense()
    c, plain = flop_cost(m), flop_cost(m.replace(num_layers=2, moe_layer_freq=1,
                                                 moe_shared_expert_intermediate_size=None))
    ranks, t = [0, 1], float(TOKENS)
    extra = TOKENS * (135168 + 272384 + 2 * (49152 + 98304)) / 1e12  # dense layer + 2 shared experts, fwd + bwd
    ep, ep0 = (_ep_group_mb_time(x, cl, ranks, ["A40"] * 2, 2, t)[0] for x in (c, plain))
    assert ep - ep0 == pytest.approx(extra, rel=1e-6)
    st = PPStage("A40", (0, 1), 0, 2, True, True)
    (pp, _), (pp0, _) = (pp_stage_time(x, cl, st, t) for x in (c, plain))
    assert pp - pp0 == pytest.approx(extra, rel=1e-6)
    assert pp_stage_params(c, st) == m.non_expert_params()
    # PP memory, no checkpointing, one microbatch: parameters (65664 + 2 x 24576) x 18 B = 2066688, the dense
    # layer's activations 1000 x 34 h = 2176000, the shared experts' intermediates 2 x 1000 x 3 S x 2 B = 1536000
    assert pp_stage_bytes(c, st, t, 1) - pp_stage_bytes(plain, st, t, 1) == pytest.approx(2066688 + 2176000 + 1536000)


def test_checkpoint_granularity():
    """tiny-dense, 1000 tokens, 2-byte activations, h=64, checkpointing. Zebra keeps L+1 = 3 stage
    inputs and recomputes stage 0 whole: an MoE layer's working set 20 h b = 2560 B/token plus the
    dense layer's 34 h = 2176 B/token. Megatron's per-layer recompute (the EP baseline) keeps 4
    layer inputs (one more: 2 h = 128 B/token) and works on one layer at a time (max(2560, 2176)).
    Difference: 1000 x (128 - 2176) = -2048000 bytes."""
    c = CostModel(tiny_dense(), flop_cost(tiny_dense()).profiles, TrainSettings(32, True))
    assert c.attention_rank_bytes(TOKENS, 1, layer_checkpoints=True) - c.attention_rank_bytes(TOKENS, 1) == -2048000


# ---------------------------------------------------------------- plans and the simulator
def test_even_plan_from_cli_carries_dense_layers(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "2", "--model", "tiny-dense",
                 "--schedule", "zebra", "-o", str(out)]) == 0
    plan = HeteroPlan.load(out)
    plan.validate(world_size=3)
    assert (plan.num_layers, plan.dense_layers, plan.model_layers, plan.moe_layer_ids) == (2, [0], 3, [1, 2])
    ref = even_plan(2, 4, 1, 2, 1, num_microbatches=1, schedule="zebra", dense_layers=[0])
    assert plan.groups == ref.groups


def test_search_plan_carries_dense_layers_and_simulates_them(tmp_path):
    cl = Cluster.load("mini-2a40-2v100")
    m = tiny_dense()
    res = search(m, cl, 32, 8)
    plan = res.plan
    assert plan is not None
    plan.validate(world_size=4)
    assert (plan.num_layers, plan.dense_layers) == (2, [0])
    assert all(len(g.placement) == 2 for g in plan.groups)
    cost = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(32))
    # the attention rank's A_F of stage 0 runs the dense layer: the same stage without it is shorter by exactly it
    a = plan.groups[0].attention_ranks[0]
    gpu = plan.gpu_types[a]
    times = {(t.kind, t.layer, t.microbatch): d for t, d in rank_task_times(plan, cost, cl, 8, a)}
    t_mb = 8 * 32 / (len(plan.groups) * len(plan.groups[0].attention_ranks) * plan.num_microbatches)
    plain = CostModel(m.replace(num_layers=2, moe_layer_freq=1), cost.profiles, cost.settings)
    assert times[("A_F", 0, 0)] - plain.stage_time(gpu, 0, t_mb) == pytest.approx(cost.dense_layer_time(gpu, t_mb))
    assert times[("A_B", 0, 0)] - plain.stage_time(gpu, 0, t_mb, True) == \
        pytest.approx(cost.dense_layer_time(gpu, t_mb, True))
    assert times[("A_F", 1, 0)] == pytest.approx(plain.stage_time(gpu, 1, t_mb))
    # a plan that does not name the dense layers is refused for this model, naming them
    bad = HeteroPlan.from_dict({**plan.to_dict(), "dense_layers": []})
    with pytest.raises(PlanError, match=r"dense layers \[0\]"):
        simulate_plan(bad, cost, cl, 8)
    # dense layers and shared experts cost time: the same search without them predicts a faster step
    lighter = search(m.replace(num_layers=2, moe_layer_freq=1, moe_shared_expert_intermediate_size=None), cl, 32, 8)
    pick = "HeterMoE (planner's pick)"
    assert lighter.by_name()[pick].step_time_s < res.by_name()[pick].step_time_s
    assert lighter.by_name()["EP"].step_time_s < res.by_name()["EP"].step_time_s
