"""Pipeline stages in a plan (HeteroPlan.pipeline_stages, even_plan(..., pipeline_stages=P)):
rank numbering, stage arithmetic and the refusals, hand-checked; and a property test that every
small even plan places each expert of each layer once, on its own stage's ranks."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, ZPGroup, even_plan


def _two_groups_two_stages() -> HeteroPlan:
    """4 MoE layers, 8 experts, 2 ZP groups of 2 stages of 2 attention + 2 expert ranks:
    group 0 = stage 0 [0, 1 | 2, 3], stage 1 [4, 5 | 6, 7]; group 1 = stage 0 [8, 9 | 10, 11],
    stage 1 [12, 13 | 14, 15]. Layers 0, 1 on stage 0, layers 2, 3 on stage 1."""
    return even_plan(4, 8, 2, 2, groups=2, pipeline_stages=2)


# ---- rank numbering and stage arithmetic -------------------------------------------------------
def test_ranks_are_numbered_group_by_group_stage_by_stage_attention_first():
    p = _two_groups_two_stages()
    assert p.world_size == 16 and p.pipeline_stages == 2
    assert p.groups[0].attention_ranks == [0, 1, 4, 5] and p.groups[0].expert_ranks == [2, 3, 6, 7]
    assert p.groups[1].attention_ranks == [8, 9, 12, 13] and p.groups[1].expert_ranks == [10, 11, 14, 15]
    assert [p.role(r) for r in range(8)] == ["attention"] * 2 + ["expert"] * 2 + ["attention"] * 2 + ["expert"] * 2
    assert p.stage_ranks(0, 0) == ([0, 1], [2, 3]) and p.stage_ranks(0, 1) == ([4, 5], [6, 7])
    assert p.stage_ranks(1, 0) == ([8, 9], [10, 11]) and p.stage_ranks(1, 1) == ([12, 13], [14, 15])


def test_stage_of_every_rank_and_stage_members():
    p = _two_groups_two_stages()
    assert [p.stage_of(r) for r in range(16)] == [0, 0, 0, 0, 1, 1, 1, 1] * 2
    assert p.stage_members(0, 0) == [0, 1, 2, 3] and p.stage_members(0, 1) == [4, 5, 6, 7]
    assert p.stage_members(1, 0) == [8, 9, 10, 11] and p.stage_members(1, 1) == [12, 13, 14, 15]
    assert [p.group_of(r) for r in range(16)] == [0] * 8 + [1] * 8


def test_layers_go_to_their_stage_and_experts_to_its_expert_ranks():
    p = _two_groups_two_stages()
    assert p.stage_model_layers(0) == [0, 1] and p.stage_model_layers(1) == [2, 3]
    assert p.stage_moe_layers(0) == [0, 1] and p.stage_moe_layers(1) == [2, 3]
    assert [p.stage_of_layer(l) for l in range(4)] == [0, 0, 1, 1]
    assert p.groups[0].placement == [{2: [0, 1, 2, 3], 3: [4, 5, 6, 7]}] * 2 + [{6: [0, 1, 2, 3], 7: [4, 5, 6, 7]}] * 2
    assert p.groups[1].placement == ([{10: [0, 1, 2, 3], 11: [4, 5, 6, 7]}] * 2
                                     + [{14: [0, 1, 2, 3], 15: [4, 5, 6, 7]}] * 2)
    assert p.local_experts(6, 0) == [] and p.local_experts(6, 2) == [0, 1, 2, 3]


def test_one_stage_is_the_whole_group():
    p = even_plan(3, 4, 2, 2, groups=2)
    assert p.pipeline_stages == 1
    assert [p.stage_of(r) for r in range(p.world_size)] == [0] * 8
    assert p.stage_members(1, 0) == p.groups[1].members == [4, 5, 6, 7]
    assert p.stage_moe_layers(0) == [0, 1, 2] and [p.stage_of_layer(l) for l in range(3)] == [0, 0, 0]
    assert p == even_plan(3, 4, 2, 2, groups=2, pipeline_stages=1)


def test_dense_layers_split_with_the_model_layers():
    # 4 model layers, model layer 0 dense: stage 0 = model layers 0, 1 (MoE layer 0 only),
    # stage 1 = model layers 2, 3 (MoE layers 1, 2).
    p = even_plan(3, 4, 1, 2, pipeline_stages=2, dense_layers=[0])
    assert p.model_layers == 4 and p.decoder_layers == 4 and p.moe_layer_ids == [1, 2, 3]
    assert p.stage_model_layers(0) == [0, 1] and p.stage_model_layers(1) == [2, 3]
    assert p.stage_moe_layers(0) == [0] and p.stage_moe_layers(1) == [1, 2]
    assert [p.stage_of_layer(l) for l in range(3)] == [0, 1, 1]
    # stage 0 = [0 | 1, 2], stage 1 = [3 | 4, 5]
    assert p.groups[0].placement == [{1: [0, 1], 2: [2, 3]}, {4: [0, 1], 5: [2, 3]}, {4: [0, 1], 5: [2, 3]}]
    # a dense layer in the middle of stage 1: model layers 0..5, dense 4; stages of 3 model layers
    q = even_plan(5, 2, 1, 1, pipeline_stages=2, dense_layers=[4])
    assert q.stage_moe_layers(0) == [0, 1, 2] and q.stage_moe_layers(1) == [3, 4]
    assert [q.stage_of_layer(l) for l in range(5)] == [0, 0, 0, 1, 1]


def test_num_attention_members_counts_one_stage():
    assert _two_groups_two_stages().num_attention_members == 4  # 2 groups x 2 members, not x 2 stages
    p = even_plan(2, 4, 4, 1, groups=2, pipeline_stages=2, attention_tp=2)
    assert p.num_attention_members == 4  # 2 groups x (4 ranks / TP 2)
    assert p.attention_members(0) == [[0, 1], [2, 3], [5, 6], [7, 8]]  # stage by stage
    assert even_plan(3, 4, 2, 1, pipeline_stages=3).num_attention_members == 2
    assert even_plan(2, 4, 3, 1, groups=3).num_attention_members == 9


def test_tp_and_stages_number_ranks_by_hand():
    p = even_plan(2, 4, 4, 1, groups=2, pipeline_stages=2, attention_tp=2)
    assert p.world_size == 20
    assert p.groups[0].attention_ranks == [0, 1, 2, 3, 5, 6, 7, 8] and p.groups[0].expert_ranks == [4, 9]
    assert p.groups[1].attention_ranks == [10, 11, 12, 13, 15, 16, 17, 18] and p.groups[1].expert_ranks == [14, 19]
    assert [p.stage_of(r) for r in range(20)] == ([0] * 5 + [1] * 5) * 2
    assert p.groups[0].placement == [{4: [0, 1, 2, 3]}, {9: [0, 1, 2, 3]}]


# ---- JSON ----------------------------------------------------------------------------------
def test_json_round_trip():
    one = even_plan(2, 4, 1, 1)
    assert "pipeline_stages" not in one.to_dict()  # reads as before the field existed
    assert HeteroPlan.from_dict(json.loads(one.to_json())) == one
    p = even_plan(3, 4, 1, 2, groups=2, pipeline_stages=2, dense_layers=[0], attention_tp=1)
    d = p.to_dict()
    assert d["pipeline_stages"] == 2
    back = HeteroPlan.from_dict(json.loads(json.dumps(d)))
    assert back == p and back.pipeline_stages == 2
    back.validate()
    d.pop("pipeline_stages")  # without the field: one stage
    assert HeteroPlan.from_dict(d).pipeline_stages == 1


def test_save_and_load(tmp_path):
    p = even_plan(2, 4, 4, 1, groups=2, pipeline_stages=2, attention_tp=2)
    p.save(tmp_path / "plan.json")
    back = HeteroPlan.load(tmp_path / "plan.json")
    assert back == p and back.pipeline_stages == 2 and back.attention_tp == 2


# ---- refusals ------------------------------------------------------------------------------
def _by_hand(P, attention, experts, placement, num_experts=2, **kw) -> HeteroPlan:
    world = len(attention) + len(experts)
    return HeteroPlan(len(placement), num_experts, ["cpu"] * world, [ZPGroup(attention, experts, placement)],
                      pipeline_stages=P, **kw)


@pytest.mark.parametrize("P", [0, -1, "2", 2.0, True, None])
def test_pipeline_stages_must_be_a_positive_integer(P):
    d = even_plan(2, 4, 1, 1).to_dict()
    d["pipeline_stages"] = P
    with pytest.raises(PlanError, match=r"pipeline_stages=.* must be a positive integer"):
        HeteroPlan.from_dict(d).validate()


def test_even_plan_refuses_zero_stages():
    with pytest.raises(PlanError, match="pipeline_stages>=1"):
        even_plan(2, 4, 1, 1, pipeline_stages=0)


def test_stages_must_divide_the_decoder_layers():
    with pytest.raises(PlanError, match="pipeline_stages=2 does not divide the 3 decoder layers"):
        even_plan(3, 4, 1, 1, pipeline_stages=2)
    with pytest.raises(PlanError, match="pipeline_stages=3 does not divide the 4 decoder layers"):
        even_plan(3, 4, 1, 1, pipeline_stages=3, dense_layers=[0])
    # a plan made by hand: the same check in validate
    plan = _by_hand(2, [0, 1], [2, 3], [{2: [0, 1]}, {2: [0, 1]}, {3: [0, 1]}])
    with pytest.raises(PlanError, match="pipeline_stages=2 does not divide the 3 decoder layers"):
        plan.validate()


def test_mtp_layers_go_with_the_last_stage():
    # 5 model layers, the last an MTP layer: 4 decoder layers split in 2, MTP with the last stage
    p = even_plan(5, 4, 1, 1, pipeline_stages=2, mtp_layers=1)
    assert p.stage_model_layers(0) == [0, 1] and p.stage_model_layers(1) == [2, 3, 4]
    assert p.stage_moe_layers(1) == [2, 3, 4] and p.stage_of_layer(4) == 1
    assert p.groups[0].placement[4] == {3: [0, 1, 2, 3]}  # the last stage's expert rank holds them
    # with virtual stages: the last chunk of the last stage (Megatron's last virtual stage)
    v = even_plan(9, 4, 1, 1, pipeline_stages=2, mtp_layers=1, virtual_stages=2)
    assert v.chunk_model_layers(1, 1) == [6, 7, 8] and v.chunk_model_layers(1, 0) == [2, 3]
    assert v.stage_of_layer(8) == 1


def test_a_stage_without_moe_layers_is_refused():
    # model layers 0, 1 dense: stage 0 of 2 has no MoE layer, its expert ranks would idle
    with pytest.raises(PlanError, match=r"pipeline stage\(s\) \[0\] of 2 hold no MoE layer"):
        even_plan(2, 4, 1, 1, pipeline_stages=2, dense_layers=[0, 1])
    with pytest.raises(PlanError, match=r"pipeline stage\(s\) \[1\] of 2 hold no MoE layer"):
        even_plan(2, 4, 1, 1, pipeline_stages=2, dense_layers=[2, 3])


def test_attention_ranks_must_split_into_stages_of_tp_members():
    # 1 attention rank, 2 stages
    plan = _by_hand(2, [0], [1, 2], [{1: [0, 1]}, {2: [0, 1]}])
    with pytest.raises(PlanError, match=r"1 attention ranks, not a multiple of pipeline_stages x "
                                         r"attention_tp x attention_cp = 2 x 1 x 1"):
        plan.validate()
    # 2 attention ranks of TP 2 (one member), 2 stages
    plan = _by_hand(2, [0, 1], [2, 3], [{2: [0, 1]}, {3: [0, 1]}], attention_tp=2)
    with pytest.raises(PlanError, match=r"2 attention ranks, not a multiple of pipeline_stages x "
                                         r"attention_tp x attention_cp = 2 x 2 x 1"):
        plan.validate()


def test_expert_ranks_must_split_into_stages():
    plan = _by_hand(2, [0, 1], [2, 3, 4], [{2: [0, 1]}, {4: [0, 1]}])
    with pytest.raises(PlanError, match="3 expert ranks, not a positive multiple of pipeline_stages=2"):
        plan.validate()
    plan = _by_hand(2, [0, 1], [], [{0: [0, 1]}, {1: [0, 1]}])
    with pytest.raises(PlanError, match="0 expert ranks, not a positive multiple of pipeline_stages=2"):
        plan.validate()


def test_an_expert_on_another_stage_is_refused():
    d = even_plan(2, 4, 1, 1, pipeline_stages=2).to_dict()  # stage 0 = [0 | 1], stage 1 = [2 | 3]
    assert d["groups"][0]["placement"] == [{"1": [0, 1, 2, 3]}, {"3": [0, 1, 2, 3]}]
    d["groups"][0]["placement"][0] = {"1": [0, 1], "3": [2, 3]}
    with pytest.raises(PlanError, match=r"layer 0 of ZP group 0 is in pipeline stage 0 but places experts on "
                                        r"rank\(s\) \[3\], outside that stage's ranks \[0, 1\]"):
        HeteroPlan.from_dict(d).validate()
    d = even_plan(2, 4, 1, 1, groups=2, pipeline_stages=2).to_dict()  # group 1: [4 | 5], [6 | 7]
    d["groups"][1]["placement"][1] = {"5": [0, 1, 2, 3]}
    with pytest.raises(PlanError, match=r"layer 1 of ZP group 1 is in pipeline stage 1 but places experts on "
                                        r"rank\(s\) \[5\]"):
        HeteroPlan.from_dict(d).validate()


def test_a_pipeline_must_ascend_with_its_stages():
    # stage 0 = attention [2] + expert [1], stage 1 = attention [0] + expert [3]: pipeline [2, 0]
    plan = _by_hand(2, [2, 0], [1, 3], [{1: [0, 1]}, {3: [0, 1]}])
    assert plan.stage_members(0, 0) == [2, 1] and plan.stage_members(0, 1) == [0, 3]
    with pytest.raises(PlanError, match=r"pipeline of attention ranks \[2, 0\] \(stage 0 to 1\) does not ascend"):
        plan.validate()
    # the same ranks listed stage by stage in rank order validate
    _by_hand(2, [0, 2], [1, 3], [{1: [0, 1]}, {3: [0, 1]}]).validate()


# ---- property ------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_every_even_plan_places_each_expert_once_on_its_stage(data):
    P = data.draw(st.integers(1, 4), label="P")
    L = P * data.draw(st.integers(1, 8 // P), label="layers per stage")
    E = data.draw(st.integers(1, 8), label="E")
    T = data.draw(st.integers(1, 2), label="T")
    M = data.draw(st.sampled_from([m for m in (1, 2, 3) if m % T == 0]), label="M")
    N = data.draw(st.integers(1, min(E, 3)), label="N")
    G = data.draw(st.integers(1, 3), label="G")
    p = even_plan(L, E, M, N, groups=G, pipeline_stages=P, attention_tp=T)
    p.validate(world_size=G * P * (M + N))
    assert p.world_size == G * P * (M + N)
    assert p.num_attention_members == G * M // T
    for gi, g in enumerate(p.groups):
        for l in range(L):
            s = p.stage_of_layer(l)
            assert s == l // (L // P)
            stage_experts = set(p.stage_ranks(gi, s)[1])
            held = [e for r, es in g.placement[l].items() for e in es]
            assert sorted(held) == list(range(E))  # each expert exactly once
            assert all(r in stage_experts for r, es in g.placement[l].items() if es)
    # every rank has exactly one stage, and the stages partition the world
    stages_of = {r: p.stage_of(r) for r in range(p.world_size)}
    assert set(stages_of.values()) == set(range(P))
    sizes = [len(p.stage_members(gi, s)) for gi in range(G) for s in range(P)]
    assert all(size == M + N for size in sizes) and sum(sizes) == p.world_size
    members = sorted(r for gi in range(G) for s in range(P) for r in p.stage_members(gi, s))
    assert members == list(range(p.world_size))
    for gi in range(G):
        for s in range(P):
            assert all(stages_of[r] == s for r in p.stage_members(gi, s))
    assert sorted(l for s in range(P) for l in p.stage_moe_layers(s)) == list(range(L))


@pytest.mark.parametrize("offload", [False, True])
def test_zebra_task_lists_per_stage_issue_one_stream_order(offload):
    """Each stage of a ZP group is its own dispatch unit: its members' zebra lists (over the stage's
    layers) issue the same collectives in the same order on each stream; a stage before the last runs
    every microbatch's last piece before the first backward of it (the next stage's forward needs all
    R outputs first), the last stage keeps Theorem 1's interleaved head."""
    from megatron_hetermoe.plan.tasks import Task, check_stream_order, zebra_tasks

    plan = even_plan(4, 4, 2, 2, num_microbatches=3, pipeline_stages=2, schedule="zebra")
    if offload:  # Asym-EA inside stage 1 (attention 4, 5; experts 6, 7): rank 4 holds expert 0 of MoE layer 2
        g = plan.groups[0]
        g.placement[2] = {4: [0], 6: [1, 2], 7: [3]}
        plan.validate()
    for stage in range(2):
        members = plan.stage_members(0, stage)
        lists = {r: zebra_tasks(plan, r) for r in members}
        check_stream_order(lists)
        a = lists[members[0]]
        assert {t.layer for t in a if t.kind in ("D_F", "C_F")} == {0, 1}  # the stage's 2 MoE layers, 0-based
        head_f = [a.index(Task("A_F", 2, j)) for j in range(3)]
        head_b = [a.index(Task("A_B", 2, j)) for j in range(3)]
        if stage == 0:
            assert max(head_f) < min(head_b)
        else:
            assert all(f < b for f, b in zip(head_f, head_b)) and head_b[0] < head_f[1]


# ---------------------------------------------------------------- zebra in waves
def test_zebra_waves_field_round_trips_and_is_validated():
    plan = even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", zebra_waves=2)
    d = plan.to_dict()
    assert d["zebra_waves"] == 2 and HeteroPlan.from_dict(d).zebra_waves == 2
    assert "zebra_waves" not in even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2).to_dict()
    for bad, match in ((3, "zebra_waves=3 must be a positive divisor of num_microbatches=4"),
                       (0, "zebra_waves=0 must be a positive divisor"), (2.0, "zebra_waves=2.0")):
        with pytest.raises(PlanError, match=match):
            even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", zebra_waves=bad)
    with pytest.raises(PlanError, match="zebra_waves=2 needs schedule 'zebra' and pipeline stages"):
        even_plan(4, 4, 1, 1, num_microbatches=4, schedule="zebra", zebra_waves=2)
    with pytest.raises(PlanError, match="it has schedule 'distep'"):
        even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, zebra_waves=2)


def test_zebra_wave_order_field_round_trips_and_is_validated():
    plan = even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", zebra_waves=2,
                     zebra_wave_order="1f1b")
    d = plan.to_dict()
    assert d["zebra_wave_order"] == "1f1b" and HeteroPlan.from_dict(d).zebra_wave_order == "1f1b"
    assert "zebra_wave_order" not in even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra",
                                               zebra_waves=2).to_dict()
    with pytest.raises(PlanError, match=r"zebra_wave_order='interleaved' is not one of \('gpipe', '1f1b'\)"):
        even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", zebra_waves=2,
                  zebra_wave_order="interleaved")
    with pytest.raises(PlanError, match="zebra_wave_order='1f1b' orders zebra_waves > 1 groups of microbatches, and "
                                        "this plan has one"):
        even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", zebra_wave_order="1f1b")


@pytest.mark.parametrize("P,W", [(2, 4), (3, 6), (4, 2)])
def test_zebra_waves_in_1f1b_order(P, W):
    """Megatron's 1F1B over the groups: stage i runs min(W, P - i) groups' forwards, then each
    group's backward followed by the next group's forward; every member of a stage issues one
    order (Asym-EA on stage 0's attention rank), and the point-to-point messages keep ascending
    microbatch order on both sides of every stage boundary."""
    from megatron_hetermoe.plan.tasks import Task, check_stream_order, wave_warmup, zebra_tasks

    R = 2 * W
    plan = even_plan(2 * P, 4, 1, 2, num_microbatches=R, pipeline_stages=P, schedule="zebra", zebra_waves=W,
                     zebra_wave_order="1f1b")
    g = plan.groups[0]
    g.placement[0] = {0: [0], 1: [1, 2], 2: [3]}  # stage 0: attention rank 0 holds expert 0 of MoE layer 0
    plan.validate()
    for stage in range(P):
        members = plan.stage_members(0, stage)
        lists = {r: zebra_tasks(plan, r) for r in members}
        check_stream_order(lists)
        a = lists[members[0]]
        warm = wave_warmup("1f1b", W, P, stage)
        assert warm == min(W, P - stage)
        # the order of group forwards (F) and backwards (B), read from the list's first pieces
        blocks = []
        for t in a:
            if t.kind in ("A_F", "A_B") and t.layer == 0 and t.microbatch % 2 == 0:
                blocks.append(("F" if t.kind == "A_F" else "B", t.microbatch // 2))
        want = [("F", w) for w in range(warm)]
        for w in range(W):
            want.append(("B", w))
            if w + warm < W:
                want.append(("F", w + warm))
        assert blocks == want, (stage, blocks)
        # at most `warm` groups alive: forwards begun minus backwards finished
        alive, peak = set(), 0
        for t in a:
            if t == Task("A_F", 0, t.microbatch):
                alive.add(t.microbatch)
            elif t == Task("A_B", 0, t.microbatch):
                alive.discard(t.microbatch)
            peak = max(peak, len(alive))
        assert peak == 2 * warm
    for b in range(P - 1):
        src, dst = plan.stage_members(0, b)[0], plan.stage_members(0, b + 1)[0]
        L = 2
        send = [t.microbatch for t in zebra_tasks(plan, src) if t.kind == "A_F" and t.layer == L]
        recv = [t.microbatch for t in zebra_tasks(plan, dst) if t.kind == "A_F" and t.layer == 0]
        grad_send = [t.microbatch for t in zebra_tasks(plan, dst) if t.kind == "A_B" and t.layer == 0]
        grad_recv = [t.microbatch for t in zebra_tasks(plan, src) if t.kind == "A_B" and t.layer == L]
        assert send == recv == grad_send == grad_recv == list(range(R))


@pytest.mark.parametrize("waves", [1, 2, 4])
def test_zebra_waves_keep_one_stream_order_and_theorem_1_inside_each_wave(waves):
    """Every member of a stage issues one order (Asym-EA in stage 1); each wave's microbatches run
    Theorem 1's forward before the next wave's, every wave's forward before the first backward; the
    stage's outputs and input gradients go in ascending microbatch order on both sides of a stage
    boundary (the point-to-point messages match by order)."""
    from megatron_hetermoe.plan.tasks import Task, check_stream_order, zebra_tasks

    plan = even_plan(4, 4, 2, 2, num_microbatches=4, pipeline_stages=2, schedule="zebra", zebra_waves=waves)
    g = plan.groups[0]
    g.placement[2] = {4: [0], 6: [1, 2], 7: [3]}
    plan.validate()
    m = 4 // waves
    for stage in range(2):
        lists = {r: zebra_tasks(plan, r) for r in plan.stage_members(0, stage)}
        check_stream_order(lists)
        a = lists[plan.stage_members(0, stage)[0]]
        for w in range(waves - 1):  # wave w's forwards all come before wave w + 1's first
            last_f = max(a.index(Task("A_F", s, j)) for s in range(2) for j in range(w * m, (w + 1) * m))
            assert last_f < a.index(Task("A_F", 0, (w + 1) * m))
        first_b = min(a.index(t) for t in a if t.kind == "A_B")
        assert all(a.index(t) < first_b for t in a if t.kind == "A_F" and (stage == 0 or t.layer < 2))
    send = [t.microbatch for t in zebra_tasks(plan, 0) if t.kind == "A_F" and t.layer == 2]
    recv = [t.microbatch for t in zebra_tasks(plan, 4) if t.kind == "A_F" and t.layer == 0]
    grad_send = [t.microbatch for t in zebra_tasks(plan, 4) if t.kind == "A_B" and t.layer == 0]
    grad_recv = [t.microbatch for t in zebra_tasks(plan, 0) if t.kind == "A_B" and t.layer == 2]
    assert send == recv == grad_send == grad_recv == [0, 1, 2, 3]


def test_virtual_stages_split_layers_as_megatron_numbers_its_virtual_stages():
    """8 layers, P 2, V 2: virtual stage v*P + s holds layers 2(v*P+s), +1; stage 0 holds chunks
    [0, 1] and [4, 5], stage 1 [2, 3] and [6, 7]; each layer's experts on its stage's expert rank."""
    plan = even_plan(8, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2)
    assert [[plan.chunk_model_layers(s, v) for v in range(2)] for s in range(2)] == [[[0, 1], [4, 5]],
                                                                                      [[2, 3], [6, 7]]]
    assert plan.stage_model_layers(0) == [0, 1, 4, 5] and plan.stage_model_layers(1) == [2, 3, 6, 7]
    assert [plan.stage_of_layer(l) for l in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [sorted(pl) for pl in plan.groups[0].placement] == [[1], [1], [3], [3], [1], [1], [3], [3]]
    # with a dense layer (model layer 2): MoE indices skip it
    plan = even_plan(7, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2, dense_layers=[2])
    assert plan.chunk_moe_layers(1, 0) == [2] and plan.chunk_moe_layers(0, 1) == [3, 4]
    assert plan.stage_moe_layers(1) == [2, 5, 6]


def test_virtual_stages_field_round_trips_and_is_validated():
    plan = even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2)
    d = plan.to_dict()
    assert d["virtual_stages"] == 2 and HeteroPlan.from_dict(d).virtual_stages == 2
    assert "virtual_stages" not in even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2).to_dict()
    for bad in (0, 2.0, "2"):
        with pytest.raises(PlanError, match=f"virtual_stages={bad!r} must be a positive integer"):
            even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=bad)
    with pytest.raises(PlanError, match=r"pipeline_stages x virtual_stages = 2 x 3 does not divide the 4 decoder "
                                        r"layers .* use virtual_stages dividing 2"):
        even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=3)
    with pytest.raises(PlanError, match="virtual_stages=2 needs pipeline stages"):
        even_plan(4, 4, 1, 1, num_microbatches=4, virtual_stages=2)
    # zebra runs virtual stages too (plan.tasks.zebra_chunk_tasks), but cuts each chunk at its MoE
    # layers: a chunk of dense layers only is refused under zebra, not under distep
    assert even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", virtual_stages=2)
    with pytest.raises(PlanError, match=r"model chunk\(s\) \(pipeline stage, chunk\) \[\(1, 0\)\] hold no MoE layer"):
        even_plan(6, 4, 1, 1, num_microbatches=4, pipeline_stages=2, schedule="zebra", virtual_stages=2,
                  dense_layers=[2, 3])
    assert even_plan(6, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2, dense_layers=[2, 3])


def test_uneven_first_and_last_stage_layers():
    """Megatron's --decoder-first/last-pipeline-num-layers: the first and last stages' counts, the
    rest split evenly over the stages between (DeepSeek-V3's 61 layers have no even split)."""
    p = even_plan(61, 8, 1, 1, pipeline_stages=4, first_stage_layers=16, last_stage_layers=13)
    assert p.stage_layer_counts() == [16, 16, 16, 13]
    assert p.stage_model_layers(3) == list(range(48, 61)) and p.stage_of_layer(47) == 2
    assert p.groups[0].placement[60] == {7: [0, 1, 2, 3, 4, 5, 6, 7]}  # the last stage's expert rank
    q = even_plan(5, 4, 1, 1, pipeline_stages=2, first_stage_layers=1, mtp_layers=1)  # 4 decoder layers
    assert q.stage_layer_counts() == [1, 3] and q.stage_model_layers(1) == [1, 2, 3, 4]  # MTP last
    assert HeteroPlan.from_dict(q.to_dict()) == q
    assert "first_stage_layers" not in even_plan(4, 4, 1, 1, pipeline_stages=2).to_dict()  # the file as before
    with pytest.raises(PlanError, match=r"the other 5 of 7 decoder layers do not split evenly over the 2 stage"):
        even_plan(7, 4, 1, 1, pipeline_stages=4, first_stage_layers=1, last_stage_layers=1)
    with pytest.raises(PlanError, match="uneven splits with virtual stages are not built"):
        even_plan(8, 4, 1, 1, pipeline_stages=2, virtual_stages=2, first_stage_layers=2)
    with pytest.raises(PlanError, match="first_stage_layers=0 must be a positive integer"):
        even_plan(4, 4, 1, 1, pipeline_stages=2, first_stage_layers=0)
    with pytest.raises(PlanError, match="does not divide the 61 decoder layers.*uneven first/last"):
        even_plan(61, 8, 1, 1, pipeline_stages=4)
