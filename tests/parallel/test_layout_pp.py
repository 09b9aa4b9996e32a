"""The rank layout with pipeline stages (parallel/layout.py: RankLayout, group_plan, MEGATRON_DIMS),
hand-checked by arithmetic alone, no process group."""
from __future__ import annotations

import pytest

from megatron_hetermoe.parallel.layout import MEGATRON_DIMS, InnerLayout, RankLayout, group_plan
from megatron_hetermoe.plan.hetero_plan import even_plan

# kinds a rank's group is created for in group_plan ("world" and "self" too)
KINDS = ("zp", "tp", "attention_dp", "attention_tp_dp", "replica", "pp", "embd", "tp_pp", "self", "world")


def _tp2_pp2():
    """2 ZP groups of 2 stages of 4 attention ranks (TP 2: 2 members) + 1 expert rank:
    group 0 = stage 0 [0, 1, 2, 3 | 4], stage 1 [5, 6, 7, 8 | 9];
    group 1 = stage 0 [10, 11, 12, 13 | 14], stage 1 [15, 16, 17, 18 | 19]."""
    return even_plan(2, 4, 4, 1, groups=2, pipeline_stages=2, attention_tp=2)


def test_layout_of_the_plan():
    plan = _tp2_pp2()
    assert plan.world_size == 20
    assert plan.groups[0].members == [0, 1, 2, 3, 5, 6, 7, 8, 4, 9]
    assert plan.groups[1].members == [10, 11, 12, 13, 15, 16, 17, 18, 14, 19]
    assert InnerLayout.of(plan) == InnerLayout(tp=2, pp=2)
    at = [RankLayout(plan, r) for r in range(20)]
    assert [lay.stage for lay in at] == ([0] * 5 + [1] * 5) * 2
    assert [lay.role for lay in at[:10]] == ["attention"] * 4 + ["expert"] + ["attention"] * 4 + ["expert"]
    assert [at[r].stage_position for r in (0, 1, 2, 3, 5, 6, 7, 8, 10, 13, 15, 18)] == [0, 1, 2, 3] * 2 + [0, 3, 0, 3]
    assert [at[r].tp_rank for r in (0, 1, 2, 3, 4, 5, 6, 9, 17, 18)] == [0, 1, 0, 1, 0, 0, 1, 0, 0, 1]
    # member over all groups, the same on every stage of a pipeline
    assert [at[r].attention_dp_rank for r in range(20)] == [0, 0, 1, 1, None, 0, 0, 1, 1, None,
                                                            2, 2, 3, 3, None, 2, 2, 3, 3, None]


def test_attention_rank_of_stage_0():
    lay = RankLayout(_tp2_pp2(), 1)
    assert (lay.role, lay.group_index, lay.stage, lay.stage_position, lay.member_index) == ("attention", 0, 0, 1, 1)
    assert lay.ranks("zp") == [0, 1, 2, 3, 4]
    assert lay.ranks("tp") == [0, 1]
    assert lay.ranks("attention_dp") == [1, 3, 11, 13]
    assert lay.ranks("attention_tp_dp") == [0, 1, 2, 3, 10, 11, 12, 13]
    assert lay.ranks("pp") == [1, 6]
    assert lay.ranks("embd") == [1, 6]
    assert lay.ranks("tp_pp") == [0, 1, 5, 6]
    assert lay.ranks("replica") == [1, 11]
    assert lay.attention_dp_rank == 0


def test_attention_rank_of_stage_1():
    lay = RankLayout(_tp2_pp2(), 17)
    assert (lay.role, lay.group_index, lay.stage, lay.stage_position, lay.member_index) == ("attention", 1, 1, 2, 6)
    assert lay.ranks("zp") == [15, 16, 17, 18, 19]
    assert lay.ranks("tp") == [17, 18]
    assert lay.ranks("attention_dp") == [5, 7, 15, 17]
    assert lay.ranks("attention_tp_dp") == [5, 6, 7, 8, 15, 16, 17, 18]
    assert lay.ranks("pp") == [12, 17]
    assert lay.ranks("embd") == [12, 17]
    assert lay.ranks("tp_pp") == [12, 13, 17, 18]
    assert lay.ranks("replica") == [7, 17]
    assert lay.attention_dp_rank == 3
    lay8 = RankLayout(_tp2_pp2(), 8)
    assert lay8.ranks("pp") == [3, 8] and lay8.ranks("tp_pp") == [2, 3, 7, 8] and lay8.attention_dp_rank == 1


@pytest.mark.parametrize("rank, stage, zp, replica", [
    (4, 0, [0, 1, 2, 3, 4], [4, 14]),
    (9, 1, [5, 6, 7, 8, 9], [9, 19]),
    (14, 0, [10, 11, 12, 13, 14], [4, 14]),
    (19, 1, [15, 16, 17, 18, 19], [9, 19]),
])
def test_expert_ranks(rank, stage, zp, replica):
    lay = RankLayout(_tp2_pp2(), rank)
    assert lay.role == "expert" and lay.stage == stage and lay.tp_rank == 0
    assert lay.ranks("zp") == zp and lay.ranks("replica") == replica
    for kind in ("tp", "pp", "embd", "tp_pp", "self"):
        assert lay.ranks(kind) == [rank]
    assert lay.ranks("attention_dp") is None and lay.ranks("attention_tp_dp") is None
    assert lay.attention_dp_rank is None


def test_gradient_owners_per_stage():
    plan = _tp2_pp2()
    # dense: attention member 0 of every stage (each stage holds its own layers); experts: group 0
    assert [r for r in range(20) if RankLayout(plan, r).owns_gradient(False)] == [0, 1, 5, 6]
    assert [r for r in range(20) if RankLayout(plan, r).owns_gradient(True)] == list(range(10))


def _check_groups(plan):
    groups = group_plan(plan)
    names = [n for n, _ in groups]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    created = [ranks for _, ranks in groups]
    for ranks in created:
        assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    for r in range(plan.world_size):
        lay = RankLayout(plan, r)
        for kind in KINDS:
            ranks = lay.ranks(kind)
            if ranks is None:
                assert lay.role == "expert" and kind in ("attention_dp", "attention_tp_dp")
                continue
            assert r in ranks and ranks in created, (r, kind, ranks)
    return groups


def test_group_plan_names_unique_and_every_rank_group_created():
    groups = dict(_check_groups(_tp2_pp2()))
    assert groups["dispatch[0]"] == [0, 1, 2, 3, 4] and groups["counts[1]"] == [5, 6, 7, 8, 9]
    assert groups["combine[2]"] == [10, 11, 12, 13, 14] and groups["dispatch[3]"] == [15, 16, 17, 18, 19]
    assert groups["tp[0]"] == [0, 1] and groups["tp[14]"] == [17, 18]  # by first index
    assert groups["attention_dp[1]@0"] == [1, 3, 11, 13] and groups["attention_dp[0]@1"] == [5, 7, 15, 17]
    assert groups["attention_tp_dp@1"] == [5, 6, 7, 8, 15, 16, 17, 18]
    assert groups["pp[0.1]"] == [1, 6] and groups["pp[1.2]"] == [12, 17]
    assert groups["embd[1.3]"] == [13, 18]
    assert groups["tp_pp[0.0]"] == [0, 1, 5, 6] and groups["tp_pp[1.2]"] == [12, 13, 17, 18]
    assert groups["replica[8]"] == [4, 14] and groups["replica[9]"] == [9, 19]
    assert groups["world"] == list(range(20))


@pytest.mark.parametrize("make", [
    lambda **kw: even_plan(2, 4, 2, 2, groups=2, **kw),
    lambda **kw: even_plan(1, 4, 4, 1, groups=2, attention_tp=2, **kw),
    lambda **kw: even_plan(3, 6, 2, 3, groups=3, attention_tp=2, dense_layers=[1], **kw),
])
def test_one_stage_groups_are_exactly_as_before(make):
    plan = make(pipeline_stages=1)
    assert group_plan(plan) == group_plan(make())
    assert not any("@" in n or n.startswith(("pp[", "embd[", "tp_pp[")) for n, _ in group_plan(plan))
    _check_groups(plan)
    for r in range(plan.world_size):
        lay = RankLayout(plan, r)
        assert lay.stage == 0
        for kind in ("pp", "embd"):
            assert lay.ranks(kind) == [r]


@pytest.mark.parametrize("make", [
    lambda: even_plan(4, 8, 2, 2, groups=2, pipeline_stages=2),
    lambda: even_plan(3, 4, 2, 1, pipeline_stages=3),
    lambda: even_plan(4, 4, 2, 1, groups=2, pipeline_stages=4, attention_tp=2),
    lambda: even_plan(5, 4, 3, 2, groups=3, pipeline_stages=3, dense_layers=[0]),
])
def test_group_plan_of_more_pipelines(make):
    _check_groups(make())


def test_three_stages_embedding_and_megatron_dims():
    # stage 0 [0, 1 | 2], stage 1 [3, 4 | 5], stage 2 [6, 7 | 8]
    plan = even_plan(3, 4, 2, 1, pipeline_stages=3)
    at = [RankLayout(plan, r) for r in range(9)]
    assert [lay.stage for lay in at] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert at[0].ranks("pp") == at[3].ranks("pp") == at[6].ranks("pp") == [0, 3, 6]
    assert at[4].ranks("pp") == [1, 4, 7]
    assert at[0].ranks("embd") == at[6].ranks("embd") == [0, 6]
    assert at[1].ranks("embd") == at[7].ranks("embd") == [1, 7]
    assert at[3].ranks("embd") == [3] and at[4].ranks("embd") == [4]  # the middle stage: the rank alone
    assert at[4].ranks("tp_pp") == [1, 4, 7]  # TP 1: the pipeline
    assert at[5].ranks("embd") == [5] and at[5].ranks("pp") == [5]
    groups = dict(_check_groups(plan))
    assert groups["embd[0.0]"] == [0, 6] and groups["pp[0.1]"] == [1, 4, 7]
    assert groups["attention_dp@1"] == [3, 4]
    for dim, kind in (("pp", "pp"), ("embd", "embd"), ("mp", "tp_pp"), ("tp_ep_pp", "tp_pp")):
        assert MEGATRON_DIMS[dim] == {"attention": kind, "expert": "self"}
        assert at[4].megatron_kind(dim) == kind and at[5].megatron_kind(dim) == "self"
    assert at[4].ranks(at[4].megatron_kind("mp")) == [1, 4, 7]
    assert at[8].ranks(at[8].megatron_kind("mp")) == [8]
