"""The pools as named grids (parallel/grid.py): HyperCommGrid's enumeration, the plan's ranks at
each position, and every rank's groups along the axes partitioning its pool."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.parallel.grid import ATTENTION_AXES, EXPERT_AXES, PoolGrid, plan_grids
from megatron_hetermoe.parallel.layout import RankLayout
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.vocabulary import Role


@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 2, 2, 3), (2, 1, 3, 2, 2)])
def test_groups_enumerate_as_megatron_cores_hyper_comm_grid(shape, monkeypatch):
    """Identity ranks: every subset of axes gives HyperCommGrid.get_rank_enum's groups, in its order."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    names = [f"a{i}" for i in range(len(shape))]
    monkeypatch.setenv("WORLD_SIZE", str(len(list(itertools.product(*map(range, shape))))))
    theirs = HyperCommGrid(list(shape), names)
    ours = PoolGrid(Role.ATTENTION, tuple(names), shape, tuple(range(theirs.size)))
    for k in range(1, len(names) + 1):
        for axes in itertools.combinations(names, k):
            assert ours.groups(axes) == theirs.get_rank_enum(list(axes)), axes


def test_a_plans_pools_by_hand():
    """TP 2 x CP 2, 2 members a stage, 2 stages, 2 ZP groups: each stage of a group is 8 attention
    ranks then 2 expert ranks (group 1: attention 20-27 and 30-37, experts 28-29 and 38-39)."""
    plan = even_plan(4, 4, 8, 2, groups=2, attention_tp=2, attention_cp=2, pipeline_stages=2)  # ranks a stage
    grids = plan_grids(plan)
    att, exp = grids[Role.ATTENTION], grids[Role.EXPERT]
    assert att.axes == ATTENTION_AXES and att.shape == (2, 2, 2, 2, 2)
    assert exp.axes == EXPERT_AXES and exp.shape == (2, 2, 2)
    assert att.coords(27) == {"tp": 1, "cp": 1, "dp": 1, "pp": 0, "zp": 1}  # rank 20 + 7
    assert att.at(tp=1, cp=1, dp=1, pp=0, zp=1) == 27
    assert att.group(27, ("tp", "cp")) == [24, 25, 26, 27]  # its member
    assert att.group(27, ("pp",)) == [27, 37]  # its pipeline: the same position a stage later
    assert att.group(27, ("dp", "zp")) == [3, 7, 23, 27]  # (TP 1, CP 1) of every stage-0 member
    assert exp.coords(38) == {"ep": 0, "pp": 1, "zp": 1} and exp.group(38, ("zp",)) == [18, 38]
    assert sorted(att.where(pp=1, zp=0) + exp.where(pp=1, zp=0)) == RankLayout(plan, 19).ranks("zp")
    with pytest.raises(KeyError, match="no axis among \\['ep'\\]"):
        att.group(27, ("ep",))
    with pytest.raises(ValueError, match="needs 8 distinct ranks"):
        PoolGrid(Role.EXPERT, EXPERT_AXES, (2, 2, 2), tuple(range(7)))


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(1, 3), members=st.integers(1, 3), experts=st.integers(1, 3), tp=st.sampled_from([1, 2]),
       cp=st.sampled_from([1, 2]), stages=st.sampled_from([1, 2]), data=st.data())
def test_every_rank_is_in_exactly_one_group_along_any_axes(groups, members, experts, tp, cp, stages, data):
    plan = even_plan(2 * stages, 4, members * tp * cp, experts, groups=groups, attention_tp=tp,
                     attention_cp=cp, pipeline_stages=stages)
    for grid in plan_grids(plan).values():
        axes = tuple(data.draw(st.lists(st.sampled_from(grid.axes), min_size=1, unique=True)))
        parts = grid.groups(axes)
        assert sorted(r for g in parts for r in g) == sorted(grid.ranks)  # a partition of the pool
        for g in parts:
            for r in g:
                assert grid.group(r, axes) == g
                fixed = {a: v for a, v in grid.coords(r).items() if a not in axes}
                assert all({a: grid.coords(o)[a] for a in fixed} == fixed for o in g)
