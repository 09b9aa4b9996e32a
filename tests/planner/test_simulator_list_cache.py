"""build_problem builds each task list's shape once per list key (simulator._list_shape) and shares
it across ranks, groups and plans: a problem built on a cache that other plans filled is the one
built from scratch, and every rank still runs exactly its plan.tasks list."""
import dataclasses

import pytest
from pp_small import GPUS, SMALL, cost

from megatron_hetermoe.plan.tasks import PipeTask, tasks_for_rank
from megatron_hetermoe.planner import simulator
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.search import build_plan

# (G, R, experts of each layer on attention ranks, schedule, P, zebra waves, wave order): plans
# that differ in exactly what a list depends on
SHAPES = [
    (1, 4, [0] * 8, "zebra", 1, 1, "gpipe"),
    (1, 4, [0] * 8, "distep", 1, 1, "gpipe"),
    (1, 2, [0] * 8, "zebra", 1, 1, "gpipe"),
    (2, 4, [0] * 8, "zebra", 1, 1, "gpipe"),
    (1, 4, [2, 0, 1, 0, 0, 3, 0, 0], "zebra", 1, 1, "gpipe"),
    (1, 4, [2, 0, 1, 0, 0, 3, 0, 0], "distep", 1, 1, "gpipe"),
    (1, 4, [0, 2, 1, 0, 0, 3, 0, 0], "zebra", 1, 1, "gpipe"),
    (1, 4, [0] * 8, "zebra", 2, 1, "gpipe"),
    (1, 4, [0] * 8, "zebra", 2, 2, "gpipe"),
    (1, 4, [0] * 8, "zebra", 2, 2, "1f1b"),
    (1, 8, [0] * 8, "zebra", 4, 4, "1f1b"),
    (1, 4, [2, 0, 1, 0, 0, 3, 0, 0], "zebra", 2, 1, "gpipe"),
]


def _plan(G, R, k, schedule, P, W, order):
    types = [GPUS[0]] * 4 * G + [GPUS[1]] * 4 * G
    plan = build_plan(SMALL, types, list(range(4 * G)), list(range(4 * G, 8 * G)), G, R, k, schedule,
                      pipeline_stages=P, zebra_waves=W, zebra_wave_order=order)
    return plan, Cluster.from_gpu_types("t", types, gpus_per_node=4)


def _problem(plan, cl, group=0):
    p = simulator.build_problem(plan, cost(), cl, plan.num_microbatches * 2 * len(plan.groups), group=group,
                                dedup=False)
    return dataclasses.replace(p, _flat=None)


def test_a_warm_cache_builds_the_same_problems():
    plans = [_plan(*s) for s in SHAPES]
    simulator._SHAPES.clear()
    cold = []
    for plan, cl in plans:
        simulator._SHAPES.clear()
        cold.append(_problem(plan, cl, len(plan.groups) - 1))
    simulator._SHAPES.clear()
    warm = [_problem(plan, cl, len(plan.groups) - 1) for plan, cl in reversed(plans)][::-1]
    assert len(simulator._SHAPES) < sum(len(p.ranks) for p in warm)  # ranks shared their lists' shapes
    for s, a, b in zip(SHAPES, cold, warm):
        assert a == b, s


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:6] + SHAPES[-2:])
def test_every_rank_runs_its_task_list(shape):
    plan, cl = _plan(*shape)
    for g in range(len(plan.groups)):
        p = _problem(plan, cl, g)
        assert sorted(p.ranks) == sorted(plan.groups[g].members)
        for r, tasks in zip(p.ranks, p.tasks):
            assert [t for t in tasks if not isinstance(t, PipeTask)] == tasks_for_rank(plan, r)
