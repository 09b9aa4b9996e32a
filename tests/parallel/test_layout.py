"""The rank layout (parallel/layout.py): plan arithmetic with no process group, hand-checked; and
megatron-core's globals (install_parallel_state) equal the groups modules get (pg_collection) on
every rank of every plan shape the suite trains."""
from __future__ import annotations

import pytest
from shared_plans import asym_ea_plan, sparse_asym_ea_plan

from megatron_hetermoe.parallel.layout import (
    COLLECTION_DIMS,
    MEGATRON_DIMS,
    InnerLayout,
    RankLayout,
    group_plan,
)
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup, even_plan


def _two_by_two_plus_two() -> HeteroPlan:
    """2 ZP groups of 2 attention + 2 expert ranks, listed out of rank order: group 0 = attention
    [0, 5] + experts [2, 3], group 1 = attention [4, 1] + experts [6, 7]."""
    place = [{2: [0, 1], 3: [2, 3]}]
    g0 = ZPGroup([0, 5], [2, 3], [dict(p) for p in place])
    g1 = ZPGroup([4, 1], [6, 7], [{6: [0, 1], 7: [2, 3]}])
    return HeteroPlan(1, 4, ["cpu"] * 8, [g0, g1])


def test_rank_arithmetic_by_hand():
    plan = _two_by_two_plus_two()
    at = {r: RankLayout(plan, r) for r in range(8)}
    assert [at[r].role for r in range(8)] == ["attention", "attention", "expert", "expert", "attention", "attention",
                                              "expert", "expert"]
    assert [at[r].group_index for r in range(8)] == [0, 1, 0, 0, 1, 0, 1, 1]
    assert [at[r].member_index for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [at[r].attention_dp_rank for r in range(8)] == [0, 3, None, None, 2, 1, None, None]
    assert at[5].ranks("zp") == [0, 2, 3, 5] and at[1].ranks("zp") == [1, 4, 6, 7]
    assert at[5].ranks("replica") == [1, 5] and at[6].ranks("replica") == [2, 6]  # position 1 in each group
    assert at[0].ranks("attention_dp") == [0, 1, 4, 5] and at[2].ranks("attention_dp") is None
    # each distinct gradient counted once: dense on attention DP rank 0, experts in ZP group 0
    assert [r for r in range(8) if at[r].owns_gradient(False)] == [0]
    assert [r for r in range(8) if at[r].owns_gradient(True)] == [0, 2, 3, 5]
    assert at[2].megatron_kind("dp") == "replica" and at[0].megatron_kind("dp") == "attention_dp"
    assert at[0].megatron_kind("expt_dp") == "replica" and at[3].megatron_kind("tp") == "self"


def test_every_rank_creates_the_same_groups_in_the_same_order():
    plan = _two_by_two_plus_two()
    names = [n for n, _ in group_plan(plan)]
    assert names[:6] == ["dispatch[0]", "combine[0]", "counts[0]", "dispatch[1]", "combine[1]", "counts[1]"]
    assert names[6:11] == ["attention_dp", "replica[0]", "replica[1]", "replica[2]", "replica[3]"]
    assert names[-1] == "world" and len(names) == 6 + 5 + 8 + 1
    for r in range(8):  # a rank's groups of each kind are among the created ones
        lay = RankLayout(plan, r)
        created = [ranks for _, ranks in group_plan(plan)]
        for kind in ("zp", "replica", "self", "world"):
            assert sorted(lay.ranks(kind)) in created


def test_every_collection_dimension_has_a_group_on_both_roles():
    assert set(COLLECTION_DIMS) <= set(MEGATRON_DIMS)
    assert all(set(kinds) == {"attention", "expert"} for kinds in MEGATRON_DIMS.values())


def test_expert_tensor_parallelism_inside_a_pool_is_not_built_yet():
    assert InnerLayout(tp=2).tp == 2
    assert InnerLayout(tp=2, pp=2).pp == 2 and InnerLayout(cp=2).cp == 2
    with pytest.raises(NotImplementedError, match="not built yet"):
        InnerLayout(etp=2)


def test_context_parallel_members_by_hand():
    """attention_tp 2 x attention_cp 2: 2 ZP groups of 2 members (4 ranks each: TP position fastest)
    + 1 expert rank: group 0 = attention [0..7] + expert [8], group 1 = attention [9..16] + expert [17]."""
    plan = even_plan(1, 4, 8, 1, groups=2, attention_tp=2, attention_cp=2)
    at = {r: RankLayout(plan, r) for r in range(18)}
    assert plan.member_size == 4 and plan.num_attention_members == 4
    assert plan.attention_members(0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [at[r].tp_rank for r in range(9)] == [0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert [at[r].cp_rank for r in range(9)] == [0, 0, 1, 1, 0, 0, 1, 1, 0]
    assert [at[r].attention_dp_rank for r in range(18)] == [0] * 4 + [1] * 4 + [None] + [2] * 4 + [3] * 4 + [None]
    assert at[6].ranks("tp") == [6, 7] and at[6].ranks("cp") == [4, 6] and at[6].ranks("tp_cp") == [4, 5, 6, 7]
    assert at[6].ranks("attention_dp") == [2, 6, 11, 15]  # TP 0, CP 1 of every member
    assert at[6].ranks("attention_dp_cp") == [0, 2, 4, 6, 9, 11, 13, 15]  # TP 0: dense gradients summed here
    assert at[6].ranks("attention_tp_dp_at_cp") == [2, 3, 6, 7, 11, 12, 15, 16]  # CP 1
    assert at[6].ranks("attention_tp_dp") == [r for r in range(17) if r != 8]
    assert at[8].ranks("cp") == [8] and at[8].ranks("attention_dp_cp") is None
    assert [r for r in range(18) if at[r].owns_gradient(False)] == [0, 1]  # member 0 at CP 0, a TP shard each
    assert at[6].megatron_kind("dp_cp") == "attention_dp_cp" and at[6].megatron_kind("cp") == "cp"
    assert at[6].megatron_kind("tp_cp") == "tp_cp" and at[8].megatron_kind("dp_cp") == "replica"
    made = [tuple(r) for _, r in group_plan(plan)]
    assert len(made) == len(set(made)) + 2 * 2  # only a ZP unit's 3 communicators share a rank set (2 units)
    for r in range(18):  # every group of two or more ranks a rank has is created
        for kind in ("zp", "tp", "attention_dp", "attention_tp_dp", "cp", "tp_cp", "attention_dp_cp",
                     "attention_tp_dp_at_cp", "replica", "world"):
            got = at[r].ranks(kind)
            assert got is None or len(got) == 1 or tuple(got) in made, (r, kind)
    cp_only = even_plan(1, 4, 2, 1, attention_cp=2)  # TP 1: the CP group is the member
    assert RankLayout(cp_only, 1).ranks("cp") == [0, 1] == RankLayout(cp_only, 1).ranks("tp_cp")
    assert sum(r == [0, 1] for _, r in group_plan(cp_only)) == 1  # made once, whatever kinds it serves
    assert "attention_cp" not in even_plan(1, 4, 2, 1).to_dict()
    assert HeteroPlan.from_dict(cp_only.to_dict()).attention_cp == 2


def _tp_two_groups() -> HeteroPlan:
    """attention_tp 2, 2 ZP groups of 2 TP-2 members + 1 expert rank: group 0 = attention [0, 1, 2, 3]
    (members [0, 1] and [2, 3]) + expert [4], group 1 = attention [5, 6, 7, 8] + expert [9]."""
    return even_plan(1, 4, 4, 1, groups=2, attention_tp=2)


def test_tensor_parallel_members_by_hand():
    plan = _tp_two_groups()
    at = {r: RankLayout(plan, r) for r in range(10)}
    assert plan.attention_members(1) == [[5, 6], [7, 8]] and plan.num_attention_members == 4
    assert [at[r].tp_rank for r in range(10)] == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0]
    # one data-parallel rank per member: both TP ranks of a member read the same microbatches
    assert [at[r].attention_dp_rank for r in range(10)] == [0, 0, 1, 1, None, 2, 2, 3, 3, None]
    assert at[2].ranks("tp") == [2, 3] and at[4].ranks("tp") == [4]
    assert at[1].ranks("attention_dp") == [1, 3, 6, 8]  # TP position 1 of every member
    assert at[6].ranks("attention_tp_dp") == [0, 1, 2, 3, 5, 6, 7, 8]
    assert at[3].ranks("zp") == [0, 1, 2, 3, 4] and at[9].ranks("replica") == [4, 9]
    assert [r for r in range(10) if at[r].owns_gradient(False)] == [0, 1]  # member 0, a shard each
    assert at[0].megatron_kind("tp") == "tp" and at[0].megatron_kind("tp_dp_cp") == "attention_tp_dp"
    assert at[4].megatron_kind("tp") == "self" and at[4].megatron_kind("tp_dp_cp") == "replica"
    names = [n for n, _ in group_plan(plan)]
    assert names[6:13] == ["tp[0]", "tp[2]", "tp[4]", "tp[6]", "attention_dp[0]", "attention_dp[1]",
                           "attention_tp_dp"]
    created = [ranks for _, ranks in group_plan(plan)]
    for r in range(10):
        for kind in ("zp", "tp", "attention_dp", "attention_tp_dp", "replica", "self", "world"):
            got = at[r].ranks(kind)
            assert got is None or got in created or kind in ("tp", "attention_tp_dp") and got == [r], (r, kind)


def test_tensor_parallel_plan_refusals():
    from megatron_hetermoe.plan.hetero_plan import PlanError

    with pytest.raises(PlanError, match="3 attention ranks, not a multiple of attention_tp x attention_cp = 2 x 1"):
        even_plan(1, 4, 3, 1, attention_tp=2)
    d = even_plan(1, 4, 2, 2, attention_tp=2).to_dict()
    assert d["attention_tp"] == 2 and "attention_tp" not in even_plan(1, 4, 2, 2).to_dict()
    assert HeteroPlan.from_dict(d).attention_tp == 2
    d["groups"][0]["placement"][0] = {"0": [0], "2": [1], "3": [2, 3]}  # expert 0 on a TP attention rank
    HeteroPlan.from_dict(d).validate()  # Asym-EA on tensor-parallel members (test_tp_parity.py)
    with pytest.raises(PlanError, match="attention_tp=0 must be a positive integer"):
        HeteroPlan.from_dict({**even_plan(1, 4, 2, 2).to_dict(), "attention_tp": 0}).validate()


PLANS = {
    "1+1": lambda: even_plan(2, 4, 1, 1), "2+2": lambda: even_plan(2, 4, 2, 2), "1+3": lambda: even_plan(2, 4, 1, 3),
    "3+1": lambda: even_plan(2, 4, 3, 1), "2x(2+2)": lambda: even_plan(2, 4, 2, 2, groups=2),
    "asym-ea 2x(1+1)": asym_ea_plan, "sparse asym-ea 2+2": sparse_asym_ea_plan,
    "tp2 2x(2x2+1)": _tp_two_groups,
}


def _agree(rank, world, plan):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hetermoe.parallel.megatron_globals import (
        install_parallel_state,
        uninstall_parallel_state,
    )
    from megatron_hetermoe.parallel.state import initialize_hetero_parallel

    hs = initialize_hetero_parallel(plan)
    install_parallel_state(hs)
    try:
        mine, mpu = hs.pg_collection(), ProcessGroupCollection.use_mpu_process_groups(list(COLLECTION_DIMS))
        differ = [d for d in COLLECTION_DIMS if getattr(mine, d) is not getattr(mpu, d)]
        return differ, ps.get_data_parallel_world_size(), list(ps._DATA_PARALLEL_GLOBAL_RANKS)
    finally:
        uninstall_parallel_state()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_globals_equal_the_modules_groups(name):
    from megatron_hetermoe.parallel.launcher import launch

    plan = PLANS[name]()
    for rank, (differ, dp_world, dp_ranks) in enumerate(launch(_agree, plan.world_size, plan)):
        assert differ == [], (name, rank, differ)
        assert dp_world == plan.num_attention_members  # the job's data-parallel size on every rank
        want = RankLayout(plan, rank).ranks("attention_dp" if plan.role(rank) == "attention" else "replica")
        assert dp_ranks == want  # the rank's own data-parallel group (gradients are reduced over it)


def test_a_live_move_keeps_the_pools_or_is_refused():
    """A move's new plan may place the experts anywhere (the same groups serve it); one where a rank
    changes role or a pool changes shape is refused before anything moves."""
    from megatron_hetermoe.plan.hetero_plan import PlanError

    plan = _two_by_two_plus_two()
    moved = HeteroPlan(1, 4, ["cpu"] * 8, [ZPGroup([0, 5], [2, 3], [{2: [0], 3: [1, 2, 3]}]),
                                           ZPGroup([4, 1], [6, 7], [{6: [], 7: [0, 1, 2, 3]}])])
    assert RankLayout(plan, 6).moved_to(moved).ranks("replica") == [2, 6]
    swapped = HeteroPlan(1, 4, ["cpu"] * 8, [ZPGroup([0, 2], [5, 3], [{5: [0, 1], 3: [2, 3]}]),
                                             ZPGroup([4, 1], [6, 7], [{6: [0, 1], 7: [2, 3]}])])
    with pytest.raises(PlanError, match=r"attention pool differs: .* ranks \[0, 5, 4, 1\] before, .* ranks "
                                        r"\[0, 2, 4, 1\] after; a move may change where experts sit only"):
        RankLayout(plan, 6).moved_to(swapped)
