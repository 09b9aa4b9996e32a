"""The distributed optimizer's checkpoint keys name its data-parallel group
(`optimizer.distributed.dp_group_idx_<i>.*`): checkpoint/megatron_optimizer.dp_group_index must give
every data-parallel group of a HeterMoE job, dense or expert, one index of its own, on every plan
shape (pipeline stages, tensor parallelism, virtual stages, several ZP groups, Asym-EA experts on
some attention ranks only). Pure arithmetic over the plan's groups (parallel/layout.py), as
megatron-core's optimizer gets them (MEGATRON_DIMS "dp" and "expt_dp")."""
from __future__ import annotations

import pytest
from shared_plans import asym_ea_plan, sparse_asym_ea_plan

from megatron_hetermoe.checkpoint.megatron_optimizer import dp_group_index
from megatron_hetermoe.parallel.layout import RankLayout
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup, even_plan


def _pp2_asym() -> HeteroPlan:
    # test_megatron_lm_pp.py's: 2 stages of 2 attention + 2 expert ranks, experts on some attention ranks.
    placement = [{2: [0, 1, 2, 3]}, {5: [0], 6: [1, 2], 7: [3]}, {1: [3], 2: [0], 3: [1, 2]}, {6: [0, 1], 7: [2, 3]}]
    return HeteroPlan(4, 4, ["cpu"] * 8, [ZPGroup([0, 1, 4, 5], [2, 3, 6, 7], placement)], num_microbatches=2,
                      pipeline_stages=2, virtual_stages=2, schedule="distep")


PLANS = {
    "pp2 1+1": lambda: even_plan(2, 4, 1, 1, num_microbatches=4, pipeline_stages=2),
    "pp2 2 groups": lambda: even_plan(2, 4, 1, 1, groups=2, num_microbatches=2, pipeline_stages=2),
    "tp2 pp2 2 groups": lambda: even_plan(2, 4, 2, 2, groups=2, num_microbatches=2, pipeline_stages=2,
                                          attention_tp=2),
    "pp2 vpp2": lambda: even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2),
    "pp2 mtp": lambda: even_plan(3, 4, 1, 1, num_microbatches=4, pipeline_stages=2, mtp_layers=1),
    "asym-ea 2x(1+1)": asym_ea_plan,
    "sparse asym-ea 2+2": sparse_asym_ea_plan,
    "pp2 vpp2 asym-ea 8 ranks": _pp2_asym,
}


@pytest.mark.parametrize("name", list(PLANS))
def test_every_data_parallel_group_has_its_own_index(name):
    plan = PLANS[name]()
    W = plan.world_size
    index_of: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank in range(W):
        lay = RankLayout(plan, rank)
        kinds = []
        if lay.role == "attention":
            kinds.append(("dense", "dp"))
        if any(plan.local_experts(rank, layer) for layer in range(plan.num_layers)):
            kinds.append(("experts", "expt_dp"))
        for kind, dim in kinds:
            group = tuple(lay.ranks(lay.megatron_kind(dim)))
            assert rank in group
            index_of.setdefault((kind, group), dp_group_index(list(group), kind == "experts", W))
    # Each member sees the same group (a kind's groups are disjoint), and no two groups share an index.
    for kind in ("dense", "experts"):
        members = [r for k, group in index_of if k == kind for r in group]
        assert len(members) == len(set(members)), (kind, index_of)
    assert len(set(index_of.values())) == len(index_of), index_of
