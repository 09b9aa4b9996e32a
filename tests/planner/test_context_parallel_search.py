"""Context parallelism on attention members (plan.attention_cp) in the planner: the K/V exchanges and
memory priced by hand, the simulator's CP plans, the search's CP sizes (cp_sizes' refusals, the
long-sequence pick with CP and the short-sequence one without), and `hetermoe plan`'s --attention-cp
and the run's --context-parallel-size."""
import pytest

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan
from megatron_hetermoe.planner import pipeline
from megatron_hetermoe.planner.cli_plan import main, run_flags_note, search_settings
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings, attention_core_flops, attention_linear_flops
from megatron_hetermoe.planner.megatron_flags import MegatronFlagsError, model_from_flags
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.search import (
    ATTENTION_CP,
    DISTEP,
    PICK,
    ZEBRA_NO_EA,
    build_plan,
    candidates,
    cp_sizes,
    search,
)
from megatron_hetermoe.planner.simulator import build_problem, simulate_plan, tokens_per_microbatch

# A hand-sized GQA model: h=1024, 8 heads of 128 channels, 2 query groups (K/V: 2 x 2 x 128 = 512
# channels a token), 4 MoE layers of 8 experts, vocab 1000.
SMALL = ModelConfig(name="cp-small", num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=2,
                    ffn_hidden_size=2048, moe_ffn_hidden_size=512, num_experts=8, moe_router_topk=2, vocab_size=1000,
                    seq_length=16384)
# The searches' model: h=2048, 16 heads, 2 query groups (TP at most 2), 8 MoE layers of 16 experts.
GQA = ModelConfig(name="cp-gqa", num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=2,
                  ffn_hidden_size=5632, moe_ffn_hidden_size=1408, num_experts=16, moe_router_topk=2, vocab_size=32000,
                  seq_length=32768)
CLUSTER = Cluster.of("cp-one-node", {"H100": 8, "A100-80GB": 8})  # the 8 attention GPUs in one node


def cost(model=SMALL, ckpt=True, gpus=("H100", "A100-80GB")):
    return CostModel(model, load_profiles(gpus), TrainSettings(model.seq_length, ckpt))


# ---------------------------------------------------------------- the cost model, by hand
def test_kv_exchange_by_hand():
    # H100: intra_node_gbs 380, link_latency_us 15. K/V of a token: 2 x 2 groups x 128 = 512 channels, fp16.
    # A rank of 4096 tokens at cp=2 receives the other rank's (2-1) x 4096 x 512 x 2 = 4_194_304 bytes:
    # 15e-6 + 4_194_304 / 380e9 s; at cp=4 three ranks': 12_582_912 bytes.
    c = cost()
    assert c.kv_width() == 512
    one = c.cp_collective_time("H100", 4096, 2)
    assert one == pytest.approx(15e-6 + 4_194_304 / 380e9, rel=1e-12)
    assert c.cp_collective_time("H100", 4096, 4) == pytest.approx(15e-6 + 12_582_912 / 380e9, rel=1e-12)
    assert c.cp_collective_time("H100", 4096, 1) == 0.0
    # a middle stage has one attention layer: forward one all-gather; backward one reduce-scatter of the
    # gradients, and one all-gather more in the re-run forward under activation checkpointing
    assert c.stage_time("H100", 1, 4096, False, cp=2) == pytest.approx(c.stage_time("H100", 1, 4096) + one)
    assert c.stage_time("H100", 1, 4096, True, cp=2) == pytest.approx(c.stage_time("H100", 1, 4096, True) + 2 * one)
    nock = cost(ckpt=False)
    assert nock.stage_time("H100", 1, 4096, True, cp=2) == pytest.approx(nock.stage_time("H100", 1, 4096, True) + one)
    # the head stage has no attention layer: nothing to exchange
    L = SMALL.num_moe_layers
    assert c.stage_time("H100", L, 4096, True, cp=4) == c.stage_time("H100", L, 4096, True)
    # TP and CP together: the TP collectives of the slice and the K/V exchange, each as priced alone
    assert c.stage_time("H100", 1, 2048, False, 2, cp=2) == pytest.approx(
        c.stage_time("H100", 1, 2048, False, 2) + c.cp_collective_time("H100", 2048, 2))


def test_dense_layers_exchange_their_keys_and_values_too():
    m = SMALL.replace(num_layers=6, moe_layer_freq=[0, 1, 0, 1, 1, 1])  # layers 0 and 2 dense
    c = cost(m)
    assert c.dense_in_stage[:2] == [1, 1]  # dense layer 0 before MoE layer 0, dense layer 2 before MoE layer 1
    one = c.cp_collective_time("H100", 4096, 2)
    for s in (0, 1):  # the stage's dense layer and its MoE layer: two attention layers
        assert c.stage_time("H100", s, 4096, False, cp=2) == pytest.approx(c.stage_time("H100", s, 4096) + 2 * one)


def test_a_cp_rank_computes_half_of_its_members_sequence_at_cp_2():
    # One sequence of S = 16384 tokens on a member of two CP ranks: each rank holds S / 2 = 8192
    # tokens (2 of the 4 chunks). Per token: projections 1024 x (8 x 128 + 2 x 2 x 128) + 1024 x 1024
    # = 2_621_440 MACs, router 1024 x 8 = 8_192 MACs: 5_259_264 FLOPs; the causal core S x 8 heads x
    # (128 + 128) = 33_554_432 FLOPs (a query meets S / 2 keys on average, wherever its chunks are).
    S, t = 16384, 8192
    lin, core = attention_linear_flops(SMALL, t), attention_core_flops(SMALL, t, S)
    assert lin == 8192 * 5_259_264 == 43_083_890_688
    assert core == 8192 * 33_554_432 == 274_877_906_944
    whole = attention_linear_flops(SMALL, S) + attention_core_flops(SMALL, S, S)
    assert whole == 635_923_595_264 == 2 * (lin + core)  # exactly half of the member's layer: load-balanced
    # the rank's stage at cp=2 is the stage on its t tokens of sequences of S, plus the K/V exchange
    c = cost()
    assert c.stage_time("H100", 1, t, False, cp=2) == pytest.approx(
        c.attention_time("H100", t, seq_len=S) + c.stage_time("H100", 1, t) - c.attention_time("H100", t)
        + 15e-6 + t * 512 * 2 / 380e9)
    assert c.stage_time("H100", 1, t, False, cp=2) < c.stage_time("H100", 1, S)


def test_memory_per_rank_by_hand():
    # the other rank's K/V of one layer at cp=2: (2-1) x 2048 tokens x 512 x 2 bytes = 2_097_152 bytes
    t, R, L = 2048, 3, SMALL.num_moe_layers
    gathered = 2_097_152
    c = cost()
    assert c.cp_gathered_bytes(t, 2) == gathered and c.cp_gathered_bytes(t, 1) == 0.0
    # with checkpointing the recomputed stage holds its one attention layer's (no dense layers); the dense
    # weights stay whole over CP (the same state bytes)
    assert c.attention_rank_bytes(t, R, cp=2) - c.attention_rank_bytes(t, R) == pytest.approx(gathered)
    # without, every layer keeps it for the core's backward, for every live microbatch
    nock = cost(ckpt=False)
    assert nock.attention_rank_bytes(t, R, cp=2) - nock.attention_rank_bytes(t, R) == pytest.approx(L * R * gathered)
    # a pipeline stage's rule agrees with the whole model's with every piece
    _, pieces = pipeline.model_pieces(SMALL, 1)
    for cm in (c, nock):
        assert cm.pipeline_attention_rank_bytes(t, R, pieces[0], True, True, cp=2) == pytest.approx(
            cm.attention_rank_bytes(t, R, cp=2))


# ---------------------------------------------------------------- the simulator
def test_simulated_cp_plan_adds_the_exchanges_and_keeps_dispatch_and_gradients():
    cl = Cluster.of("t", {"H100": 4, "A100-80GB": 4})
    c = cost()
    B = 4
    kw = dict(attention_gpu="H100", expert_gpu="A100-80GB", schedule="zebra", num_microbatches=2)
    p1 = even_plan(SMALL.num_layers, 8, 4, 4, **kw)
    p2 = even_plan(SMALL.num_layers, 8, 4, 4, attention_cp=2, **kw)  # 2 members of 2 CP ranks
    a, b = build_problem(p1, c, cl, B), build_problem(p2, c, cl, B)
    t_mb = B * SMALL.seq_length / (4 * 2)  # a rank's tokens per microbatch: the same 4 ranks, the same share
    assert tokens_per_microbatch(p2, B * SMALL.seq_length) == t_mb
    for tk, d1, d2 in zip(a.tasks[0], a.dur[0], b.dur[0]):
        if tk.kind in ("A_F", "A_B"):
            assert d2 - d1 == pytest.approx(c.cp_comm_time("H100", tk.layer, t_mb, 2, tk.kind == "A_B"))
    assert a.coll_dur == b.coll_dur  # each CP rank dispatches its own tokens: the same bytes
    assert b.post_step == a.post_step  # dense weights replicated over CP: all 4 ranks all-reduce them whole
    assert simulate_plan(p2, c, cl, B).step_time_s > simulate_plan(p1, c, cl, B).step_time_s
    # against 2 members of one rank each: a CP rank dispatches half of its member's tokens
    two = even_plan(SMALL.num_layers, 8, 2, 4, **kw)
    assert tokens_per_microbatch(p2, B * SMALL.seq_length) == tokens_per_microbatch(two, B * SMALL.seq_length) / 2


@pytest.mark.parametrize("schedule", ["zebra", "distep"])
def test_pipelined_cp_plan_prices_the_exchanges(schedule):
    c = cost()
    kw = dict(attention_gpu="H100", expert_gpu="A100-80GB", schedule=schedule, num_microbatches=2,
              pipeline_stages=2)
    p1 = even_plan(SMALL.num_layers, 8, 4, 4, **kw)
    p2 = even_plan(SMALL.num_layers, 8, 4, 4, attention_cp=2, **kw)
    cl = Cluster.from_gpu_types("t", p1.gpu_types)  # stage by stage: 4 H100, 4 A100, 4 H100, 4 A100
    assert pipeline.layout_of_plan(p2).cp == 2
    assert simulate_plan(p2, c, cl, 8).step_time_s > simulate_plan(p1, c, cl, 8).step_time_s


# ---------------------------------------------------------------- what the search tries
def test_cp_sizes_name_why_a_size_is_unusable():
    attn = list(range(8))
    assert cp_sizes(CLUSTER, GQA, 32768, attn) == {cp: "" for cp in ATTENTION_CP}
    why = cp_sizes(CLUSTER, GQA, 24, attn)  # 24 tokens: 16 chunks do not divide them
    assert why[2] == why[4] == ""
    assert why[8] == ("attention_cp 8: the sequence length 24 does not split into 2 x 8 = 16 chunks (Megatron's "
                      "load-balanced split); use a sequence length that is a multiple of 16, or a smaller attention_cp")
    # 24 / 4 = 6 tokens a CP rank do not split over TP 4
    assert cp_sizes(CLUSTER, GQA, 24, attn, tp=4)[4] == ("attention_cp 4: a CP rank's 6 tokens do not split over "
                                                         "attention_tp 4 (sequence parallelism)")
    # nodes of 4 GPUs: a member of 8 (or of TP 2 x CP 4) would span two
    split = Cluster.of("4-per-node", {"H100": 8, "A100-80GB": 8}, gpus_per_node=4)
    assert cp_sizes(split, GQA, 32768, attn)[4] == ""
    assert cp_sizes(split, GQA, 32768, attn)[8] == ("attention_cp 8 with attention_tp 1: the attention ranks do not "
                                                    "form members of 1 x 8 = 8 ranks inside one node (TP and CP run on "
                                                    "the intra-node link)")
    assert "members of 2 x 4 = 8 ranks inside one node" in cp_sizes(split, GQA, 32768, attn, tp=2)[4]
    assert all(c.cp < 8 and c.member <= 4 for c in candidates(split, GQA, 8, seq_len=32768))
    # plans refuse CP with multi-token prediction, so the search does not try it
    mtp = GQA.replace(mtp_num_layers=1)
    assert "multi-token prediction" in cp_sizes(CLUSTER, mtp, 32768, attn)[2]
    assert {c.cp for c in candidates(CLUSTER, mtp, 8, seq_len=32768)} == {1}


def test_search_refuses_a_cp_size_it_does_not_try():
    with pytest.raises(ValueError, match=r"attention_cp=\[3\]: the search tries \[1, 2, 4, 8\]"):
        search(GQA, CLUSTER, 32768, 8, attention_cp=(3,), baselines=False)


def test_cp_candidates_only_where_members_without_cp_cannot_get_that_many_microbatches():
    # short sequences, many of them: every R a CP shape could use, the same shape without CP has too
    short = candidates(CLUSTER, GQA, 64, seq_len=2048)
    plain = {(id(c.attention_ranks), c.G, c.R, c.tp, c.P) for c in short if c.cp == 1}
    cps = [c for c in short if c.cp > 1]
    assert cps and all((id(c.attention_ranks), c.G, c.R, c.tp, c.P) not in plain for c in cps)
    # long sequences, few of them: 8 sequences over 8 attention ranks give one each without CP (R = 1);
    # members of 4 CP ranks get 4 each (R up to 4)
    long = candidates(CLUSTER, GQA, 8, seq_len=32768)
    h100 = [c for c in long if c.P == 1 and c.tp == 1 and c.G == 1 and CLUSTER.gpu_types()[c.attention_ranks[0]] ==
            "H100"]
    assert {c.R for c in h100 if c.cp == 1} == {1}
    assert {c.R for c in h100 if c.cp == 4} == {2, 4}  # R = 1 is the shape without CP's
    assert all(c.cp == 1 or c.R > 1 for c in long if c.G == 1 and c.tp == 1)


# ---------------------------------------------------------------- the picks
@pytest.mark.parametrize("seq,batch", [(32768, 8), (16384, 16)])
def test_long_sequences_pick_context_parallelism(seq, batch, tmp_path):
    model = GQA.replace(seq_length=seq)
    res = search(model, CLUSTER, seq, batch, baselines=False)
    without = search(model, CLUSTER, seq, batch, attention_cp=(1,), baselines=False).by_name()[PICK]
    pick = res.by_name()[PICK]
    print(f"seq {seq}, batch {batch}: pick attention_cp {pick.detail['attention_cp']} "
          f"(tp {pick.detail['attention_tp']}, R {pick.detail['microbatches']}) {pick.step_time_s:.4f} s; without "
          f"CP (tp {without.detail['attention_tp']}, R {without.detail['microbatches']}) {without.step_time_s:.4f} s")
    cp = pick.detail["attention_cp"]
    assert cp > 1 and pick.step_time_s < without.step_time_s
    assert pick.detail["attention_gpu"] == "H100" and pick.detail["pipeline_stages"] == 1
    assert not any(pick.detail["experts_on_attention_per_layer"])  # no Asym-EA with CP
    plan = res.plan
    assert plan.attention_cp == cp and plan.attention_tp == pick.detail["attention_tp"]
    plan.validate(world_size=16)
    # the plan file carries attention_cp and reads back the same
    path = tmp_path / "plan.json"
    plan.save(path)
    back = HeteroPlan.load(path)
    assert back.attention_cp == cp and back.to_dict() == plan.to_dict()
    assert back.num_attention_members == 8 // (cp * plan.attention_tp)
    # the Megatron flags it trains with name the CP size
    note = run_flags_note(plan, batch, model)
    assert f"--context-parallel-size {cp}" in note
    assert f"--micro-batch-size {batch // (back.num_attention_members * plan.num_microbatches)}" in note


def test_short_sequences_keep_cp_1():
    model = GQA.replace(seq_length=2048)
    res = search(model, CLUSTER, 2048, 64, baselines=False)
    plain = search(model, CLUSTER, 2048, 64, attention_cp=(1,), baselines=False)
    assert res.candidates > plain.candidates  # CP shapes were tried
    pick = res.by_name()[PICK]
    assert pick.detail["attention_cp"] == 1 and res.plan.attention_cp == 1
    assert pick.step_time_s == plain.by_name()[PICK].step_time_s
    assert "--context-parallel-size" not in run_flags_note(res.plan, 64, model)
    # forced onto CP 2 the best is slower: its exchanges buy nothing at this length
    forced = search(model, CLUSTER, 2048, 64, attention_cp=(2,), baselines=False).by_name()
    print(f"seq 2048, batch 64: pick (cp 1) {pick.step_time_s:.4f} s; forced cp 2 {forced[PICK].step_time_s:.4f} s")
    assert forced[PICK].detail["attention_cp"] == 2 and forced[PICK].step_time_s > pick.step_time_s
    for name in (DISTEP, ZEBRA_NO_EA):
        assert forced[name].detail["attention_cp"] == 2 and forced[name].step_time_s > res.by_name()[name].step_time_s


def test_no_asym_ea_on_context_parallel_members():
    with pytest.raises(PlanError, match="attention_cp=2: the search prices Asym-EA on one-rank members only"):
        build_plan(GQA, CLUSTER.gpu_types(), list(range(8)), list(range(8, 16)), 1, 2, [1] * 8, attention_cp=2)
    plan = build_plan(GQA, CLUSTER.gpu_types(), list(range(8)), list(range(8, 16)), 1, 2, [0] * 8, attention_cp=2)
    assert plan.attention_cp == 2 and plan.num_attention_members == 4


# ---------------------------------------------------------------- hetermoe plan
RUN = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
       "--num-query-groups", "2", "--ffn-hidden-size", "5632", "--moe-ffn-hidden-size", "1408", "--num-experts", "16",
       "--vocab-size", "32000", "--seq-length", "32768", "--global-batch-size", "8"]


def test_megatron_flags_read_the_context_parallel_size():
    assert model_from_flags(RUN).run.context_parallel_size == 1
    assert model_from_flags([*RUN, "--context-parallel-size", "4"]).run.context_parallel_size == 4
    with pytest.raises(MegatronFlagsError, match="--context-parallel-size 0 after --: must be >= 1"):
        model_from_flags([*RUN, "--context-parallel-size", "0"])


def test_even_plan_takes_attention_cp_and_the_runs_cp(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--even", "--attention-ranks", "4", "--expert-ranks", "2", "--attention-cp", "2", "--model", "tiny",
                 "-o", str(out)]) == 0
    plan = HeteroPlan.load(out)
    assert plan.attention_cp == 2 and plan.num_attention_members == 2
    assert "attention_cp 2" in capsys.readouterr().out
    # from the run's flags: its CP size, and R = 8 sequences / (micro batch 1 x 8 ranks / CP 4 = 2 members)
    assert main(["--even", "--attention-ranks", "8", "--expert-ranks", "8", "-o", str(out), "--", *RUN,
                 "--context-parallel-size", "4"]) == 0
    plan = HeteroPlan.load(out)
    assert (plan.attention_cp, plan.num_microbatches) == (4, 4)
    assert main(["--even", "--attention-ranks", "8", "--expert-ranks", "8", "--attention-cp", "2", "-o", str(out),
                 "--", *RUN, "--context-parallel-size", "4"]) == 2
    assert ("--attention-cp 2 and the run's --context-parallel-size 4 (after --; Megatron's default where the flag is "
            "absent) disagree" in capsys.readouterr().err)
    # 2 x CP must divide the sequence
    assert main(["--even", "--attention-ranks", "8", "--expert-ranks", "8", "-o", str(out), "--",
                 *[("32760" if v == "32768" else v) for v in RUN], "--context-parallel-size", "8"]) == 2
    assert "attention CP 8 (--attention-cp, or the run's --context-parallel-size) must be a positive integer with " \
           "2 x CP dividing the sequence length 32760" in capsys.readouterr().err


def test_search_flags_and_the_runs_cp(tmp_path, capsys):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("name: cp-test\nnode_groups:\n"
                    "  - {gpu: H100, nodes: 1, gpus_per_node: 8, nic_gbps_per_gpu: 400}\n"
                    "  - {gpu: A100-80GB, nodes: 1, gpus_per_node: 8, nic_gbps_per_gpu: 200}\n")
    assert main(["--cluster", str(yaml), "--attention-cp", "3", "--", *RUN]) == 2
    assert "--attention-cp 3: the search tries [1, 2, 4, 8]" in capsys.readouterr().err
    out = tmp_path / "p.json"
    assert main(["--cluster", str(yaml), "-o", str(out), "--", *RUN, "--context-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert HeteroPlan.load(out).attention_cp == 2  # the run's CP size is the only one searched
    assert "attention_cp 2) + 8 expert ranks" in text and "--context-parallel-size 2" in text
    # without the flag the search tries every size; with a disagreeing --attention-cp it refuses by name
    args = type("A", (), {"attention_tp": None, "attention_cp": None, "pipeline_stages": None,
                          "expert_recompute": "auto", "distributed_optimizer": False})()
    assert search_settings(args, model_from_flags(RUN).run)["attention_cp"] is None
    assert search_settings(args, model_from_flags([*RUN, "--context-parallel-size", "4"]).run)["attention_cp"] == (4,)
    args.attention_cp = 2
    with pytest.raises(ValueError, match="--attention-cp 2 and the run's --context-parallel-size 4"):
        search_settings(args, model_from_flags([*RUN, "--context-parallel-size", "4"]).run)
