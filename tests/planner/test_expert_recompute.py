"""Expert activation recomputation (issue 30, item 5): what expert holders keep for the expert
backward is a level the cost model prices (memory and time) and the search picks where memory
binds. Hand-checked memory for a tiny model; the simulator's backward expert tasks and C_B
priced as the cost model says; the O1 / D1 / 32K / batch 60 flip to attention on V100 gone."""

import pytest

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.tasks import Task
from megatron_hetermoe.planner.cluster import Cluster, Links, rank1_collective_time
from megatron_hetermoe.planner.cost_model import (
    EXPERT_RECOMPUTE,
    CostModel,
    TrainSettings,
    heavier_expert_recompute,
)
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.search import LIMIT_ROWS, PICK, ZEBRA_NO_EA, build_plan, layout_name, search
from megatron_hetermoe.planner.simulator import build_problem


def tiny_cost(level: str | None, ckpt: bool = True) -> CostModel:
    # tiny: h=64, expert ffn f=128, E=4, top-2, 2 MoE layers; memory needs no profile
    return CostModel(ModelConfig.load("tiny"), {}, TrainSettings(32, ckpt, expert_recompute=level))


def test_default_level_is_the_rule_before_levels():
    assert tiny_cost(None).settings.expert_recompute == "keep-inputs"
    assert tiny_cost(None, ckpt=False).settings.expert_recompute == "off"
    assert heavier_expert_recompute("keep-inputs") == ("keep-inputs", "resend-inputs")
    assert heavier_expert_recompute("off") == EXPERT_RECOMPUTE


def test_bad_level_is_named():
    with pytest.raises(ValueError, match="'some'.*resend-inputs"):
        TrainSettings(32, expert_recompute="some")
    with pytest.raises(ValueError, match="expert_recompute='some'"):
        search(ModelConfig.load("tiny"), Cluster.load("mini-2a40-2v100"), 32, 4, expert_recompute="some")


def test_per_expert_memory_by_hand():
    # one expert's state: 3 x 64 x 128 = 24,576 params x 18 B = 442,368 B
    # per routed token kept, 2-byte activations:
    #   off:           input 64 + SwiGLU intermediates 3 x 128 = 448 values x 2 B = 896 B
    #   keep-inputs:   input 64 x 2 B                                         = 128 B
    #   resend-inputs: nothing                                                =   0 B
    # 100 routed tokens per microbatch x 3 live microbatches = 300 tokens:
    #   off 442,368 + 268,800; keep-inputs 442,368 + 38,400; resend-inputs 442,368
    want = {"off": 711_168, "keep-inputs": 480_768, "resend-inputs": 442_368}
    for level, b in want.items():
        assert tiny_cost(level).per_expert_bytes(100, 3) == b, level


def test_attention_rank_keeps_the_tokens_it_resends():
    # resend-inputs: 2 MoE layers x 50 tokens x top-2 copies x 64 x 2 B x 3 live microbatches = 76,800 B
    keep, resend = tiny_cost("keep-inputs"), tiny_cost("resend-inputs")
    assert resend.resent_bytes(50, 3) == 76_800 and keep.resent_bytes(50, 3) == 0
    assert resend.attention_rank_bytes(50, 3) - keep.attention_rank_bytes(50, 3) == 76_800
    # the level changes only the experts' memory: attention stages keep what checkpointing says
    assert tiny_cost("off").attention_rank_bytes(50, 3) == keep.attention_rank_bytes(50, 3)


def _d1_cost(level: str) -> CostModel:
    m = ModelConfig.load("d1")
    return CostModel(m, load_profiles({"A40", "V100-16GB"}), TrainSettings(4096, expert_recompute=level))


def test_expert_backward_reruns_the_forward_unless_off():
    off, keep, resend = (_d1_cost(lv) for lv in EXPERT_RECOMPUTE)
    for g in ("A40", "V100-16GB"):
        f, b = off.expert_time(g, 4096), off.expert_time(g, 4096, True)
        assert keep.expert_time(g, 4096) == resend.expert_time(g, 4096) == f
        assert keep.expert_time(g, 4096, True) == resend.expert_time(g, 4096, True) == pytest.approx(b + f)
        # attention stages (dense layers, shared experts) follow activation checkpointing, not the level
        assert off.stage_time(g, 1, 4096, True) == keep.stage_time(g, 1, 4096, True)


def test_simulator_prices_backward_expert_tasks_and_resent_tokens():
    """One A40 attention rank + one V100 expert rank, 1 MoE layer of 2 experts, R=1: E_B is the
    cost model's expert backward at each level; C_B carries twice D_F's bytes with resend-inputs."""
    model = ModelConfig.load("d1").replace(num_layers=1, num_experts=2)
    cl = Cluster.of("t", {"A40": 1, "V100-16GB": 1}, nic_gbps=100, gpus_per_node=4)
    plan = build_plan(model, cl.gpu_types(), [0], [1], 1, 1, [0])
    profiles = load_profiles({"A40", "V100-16GB"})
    probs = {lv: build_problem(plan, CostModel(model, profiles, TrainSettings(2048, expert_recompute=lv)), cl,
                               global_batch=2, dedup=False) for lv in EXPERT_RECOMPUTE}
    tokens_per_expert = 2 * 2048 * 2 / 2  # 2 sequences on 1 attention rank, top-2, 2 experts: 4096
    for lv, p in probs.items():
        cost = CostModel(model, profiles, TrainSettings(2048, expert_recompute=lv))
        dur = {t: d for tasks, ds in zip(p.tasks, p.dur) for t, d in zip(tasks, ds) if not t.is_comm}
        assert dur[Task("E_B", 0, 0)] == pytest.approx(2 * cost.expert_time("V100-16GB", tokens_per_expert, True))
        comm = dict(zip(p.coll_tasks, p.coll_dur))
        links = Links.for_ranks(cl, [0, 1], profiles)
        d_f = rank1_collective_time(links, [4096.0, 0.0], [0.0, 1.0], 2 * cost.token_bytes())
        assert comm[Task("D_F", 0, 0)] == pytest.approx(d_f)
        c_b = rank1_collective_time(links, [4096.0, 0.0], [0.0, 1.0], (2 if lv == "resend-inputs" else 1)
                                    * 2 * cost.token_bytes())
        assert comm[Task("C_B", 0, 0)] == pytest.approx(c_b), lv
        # the payload doubles, the start-up latency does not
        if lv == "resend-inputs":
            assert c_b - links.latency_s == pytest.approx(2 * (d_f - links.latency_s))


# ---------------------------------------------------------------- O1 / D1 / 32K / batch 60
A40_ATT = layout_name(["A40"] * 6 + ["V100-16GB"] * 6, list(range(6)), list(range(6, 12)))


def test_o1_d1_32k_batch60_v100_memory_by_hand():
    """Zebra without Asym-EA, attention on 6 A40, experts on 6 V100 (G=1, R=10), D1 at 32K:
      usable V100 = 16 GiB x 0.9                                      = 15,461,882,265.6 B
      experts per V100: 8 layers x 24 / 6                             = 32
      one expert's state: 3 x 1024 x 3584 params x 18 B               = 198,180,864 B
      routed tokens per expert per step: 60 x 32768 x top-2 / 24      = 163,840 (all R alive)
        keep-inputs: x 1024 x 2 B                                     = 335,544,320 B
      working set, R=10: 6 x 32768 x 2 / 24 = 16,384 tokens x 3584 x 2 B x 4 = 469,762,048 B
      keep-inputs: (15,461,882,265.6 - 469,762,048) / 533,725,184 = 28.09 -> 28 experts < 32
      resend-inputs: 32 x 198,180,864 + 469,762,048 = 6,811,549,696 B: fits
    and the A40s keep the tokens they resend: 8 layers x 32,768 tokens x 2 x 2048 B x 10 live
    microbatches = 10,737,418,240 B."""
    cost = {lv: CostModel(ModelConfig.load("d1").replace(seq_length=32768), load_profiles({"A40", "V100-16GB"}),
                          TrainSettings(32768, expert_recompute=lv)) for lv in ("keep-inputs", "resend-inputs")}
    usable = cost["keep-inputs"].profile("V100-16GB").usable_memory_bytes
    assert usable == pytest.approx(15_461_882_265.6)
    work = cost["keep-inputs"].expert_working_bytes(16_384)
    assert work == 469_762_048
    assert cost["keep-inputs"].per_expert_bytes(16_384, 10) == 198_180_864 + 335_544_320
    assert (usable - work) // cost["keep-inputs"].per_expert_bytes(16_384, 10) == 28
    assert 32 * cost["resend-inputs"].per_expert_bytes(16_384, 10) + work == 6_811_549_696 < usable
    assert cost["resend-inputs"].resent_bytes(32_768, 10) == 10_737_418_240


def test_o1_d1_32k_batch60_no_longer_flips_to_attention_on_v100():
    m, cl = ModelConfig.load("d1"), Cluster.load("o1")
    before = search(m, cl, 32768, 60, expert_recompute="keep-inputs")  # the planner before the levels
    no_ea = before.by_name()[ZEBRA_NO_EA]
    assert no_ea.detail["layout"] == "attention on 6 V100-16GB, experts on 6 A40"
    assert "must hold 32 experts but fits 28" in no_ea.detail["excluded_layouts"][A40_ATT]

    after = search(m, cl, 32768, 60)
    a = after.by_name()
    assert a[ZEBRA_NO_EA].detail["layout"] == A40_ATT and A40_ATT not in a[ZEBRA_NO_EA].detail["excluded_layouts"]
    assert a[ZEBRA_NO_EA].detail["expert_recompute"] == "resend-inputs"
    # attention back on the A40s is ~3x faster than the V100-attention layout it had to take
    assert a[ZEBRA_NO_EA].step_time_s < 0.5 * no_ea.step_time_s
    # the pick may only get faster with more levels to choose from, and says which it took
    assert a[PICK].step_time_s <= before.by_name()[PICK].step_time_s
    assert after.plan.expert_recompute == a[PICK].detail["expert_recompute"]


def test_levels_beyond_the_default_only_where_memory_binds():
    # a small batch fits without Asym-EA at keep-inputs: no heavier level is tried, nothing changes
    m, cl = ModelConfig.load("d1"), Cluster.load("o1")
    auto, fixed = (search(m, cl, 4096, 24, expert_recompute=lv, baselines=False) for lv in ("auto", "keep-inputs"))
    for name, p in auto.by_name().items():
        q = fixed.by_name()[name]
        assert p.step_time_s == q.step_time_s, name
        if p.fits and name not in LIMIT_ROWS:
            assert p.detail["expert_recompute"] == "keep-inputs", name
