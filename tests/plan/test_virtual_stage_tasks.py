"""Zebra's task lists with Megatron's virtual pipeline stages (plan.tasks.zebra_chunk_tasks): each
(model chunk, wave) item is Theorem 1 over the chunk's MoE layers, the items in Megatron's
interleaved 1F1B over the waves (or every forward first); one chunk is the list without virtual
stages. The lists' collective order and their pipeline calls are checked in test_issue_order.py."""
from __future__ import annotations

import pytest

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.tasks import (
    PipeTask,
    Task,
    check_stream_order,
    inputs,
    stage_transfers,
    task_layers,
    wave_warmup,
    zebra_chunk_tasks,
    zebra_interleaved_items,
    zebra_tasks,
    zebra_tasks_for_role,
)


def test_interleaved_items_are_megatrons_interleaved_1f1b_over_the_waves():
    """Megatron-core's own schedule table and warm-up (schedules.distep.interleaved_order calls them),
    with the waves as its microbatches; each chunk's waves go forward and backward in order."""
    from megatron_hetermoe.schedules.distep import interleaved_order

    for P in (2, 3, 4):
        for V in (2, 3):
            for W in range(1, 9):
                for s in range(P):
                    items = zebra_interleaved_items("1f1b", W, P, s, V)
                    assert [(x, c) for x, c, _ in items] == interleaved_order(W, P, s, V, P), (P, V, W, s)
                    for c in range(V):
                        for x in "FB":
                            assert [w for y, cc, w in items if (y, cc) == (x, c)] == list(range(W))
                    gpipe = zebra_interleaved_items("gpipe", W, P, s, V)
                    assert [x for x, _, _ in gpipe] == ["F"] * W * V + ["B"] * W * V
                    assert sorted(gpipe) == sorted(items)


def test_two_chunks_by_hand():
    """P 2, V 2, one MoE layer a chunk, 2 waves of one microbatch, 1f1b. Stage 1's second chunk is the
    model's last virtual stage: its head's forward runs with its backward (Theorem 1); every other
    chunk's head runs in its wave's forward (its output goes on to the next virtual stage)."""
    A_F = lambda s, j, c=0: Task("A_F", s, j, c)  # noqa: E731
    A_B = lambda s, j, c=0: Task("A_B", s, j, c)  # noqa: E731
    T = Task
    # stage 1: warm-up (P - 1 - 1) * 2 + (V - 1) * P = 2 waves: chunk 0's two, then 1F1B
    got = zebra_chunk_tasks((1, 1), 2, "attention", (), 1, 2, 2, "1f1b")

    def fwd(j, c, head=True):
        return [A_F(0, j, c), T("D_F", c, j), T("C_F", c, j)] + ([A_F(1, j, c)] if head else [])

    def bwd(j, c, head=False):
        return ([A_F(1, j, c)] if head else []) + [A_B(1, j, c), T("C_B", c, j), T("D_B", c, j), A_B(0, j, c)]

    assert got == (fwd(0, 0) + fwd(1, 0) + fwd(0, 1, False) + bwd(0, 1, True) + fwd(1, 1, False) + bwd(1, 1, True)
                   + bwd(0, 0) + bwd(1, 0))
    # stage 0: warm-up 2 + 2 = 4 = every forward
    assert zebra_chunk_tasks((1, 1), 2, "attention", (), 0, 2, 2, "1f1b") == (
        fwd(0, 0) + fwd(1, 0) + fwd(0, 1) + fwd(1, 1) + bwd(0, 1) + bwd(1, 1) + bwd(0, 0) + bwd(1, 0))
    # the expert rank computes in the order its stage's attention rank dispatches
    ex = zebra_chunk_tasks((1, 1), 2, "expert", (), 1, 2, 2, "1f1b")
    assert [t for t in ex if t.kind in ("E_F", "E_B")] == [
        T("E_F", 0, 0), T("E_F", 0, 1), T("E_F", 1, 0), T("E_B", 1, 0), T("E_F", 1, 1), T("E_B", 1, 1),
        T("E_B", 0, 0), T("E_B", 0, 1)]
    check_stream_order({0: got, 1: ex})


def test_inputs_and_transfers_follow_the_chunks():
    """A chunk's A tasks read its own MoE layers' transfers (the rank's layers after the earlier
    chunks'); its first piece receives the previous virtual stage's output (stage 0's next chunk from
    stage P - 1), its last piece sends to the next one; the model's first and last virtual stages
    neither receive nor send there."""
    L = (2, 3)
    assert inputs(Task("A_F", 1, 0, 1), L) == Task("C_F", 2, 0)
    assert inputs(Task("A_B", 2, 0, 1), L) == Task("D_B", 4, 0)
    assert inputs(Task("A_B", 3, 0, 1), L) is None and inputs(Task("A_F", 0, 0, 1), L) is None
    assert inputs(Task("A_F", 1, 0), 2) == Task("C_F", 0, 0) == inputs(Task("A_F", 1, 0), (2,))
    # P 2: virtual stage of chunk c on stage s is 2c + s
    assert stage_transfers(Task("A_F", 0, 3, 1), 0, 2, L) == (PipeTask("P_F", 1, 3), None)
    assert stage_transfers(Task("A_F", 2, 3, 0), 0, 2, L) == (None, PipeTask("P_F", 0, 3))
    assert stage_transfers(Task("A_F", 0, 3, 0), 0, 2, L) == (None, None)  # the model's first
    assert stage_transfers(Task("A_F", 3, 3, 1), 1, 2, L) == (None, None)  # the model's last
    assert stage_transfers(Task("A_B", 3, 3, 1), 0, 2, L) == (PipeTask("P_B", 3, 3), None)
    assert stage_transfers(Task("A_B", 0, 3, 1), 0, 2, L) == (None, PipeTask("P_B", 2, 3))


def test_plan_lists_per_chunk_and_one_chunk_unchanged():
    """zebra_tasks of a plan with virtual stages runs each chunk's MoE layers (dense layers skipped);
    with one chunk zebra_chunk_tasks is the list without virtual stages."""
    plan = even_plan(7, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2, schedule="zebra",
                     zebra_waves=2, zebra_wave_order="1f1b", dense_layers=[2])
    assert task_layers(plan, 0) == (2, 2) and task_layers(plan, 1) == (1, 2)
    for r in range(plan.world_size):
        tasks = zebra_tasks(plan, r)
        stage = plan.stage_of(r)
        assert {t.layer for t in tasks if t.kind == "D_F"} == set(range(len(plan.stage_moe_layers(stage))))
    for stage in range(3):
        for order, W in (("gpipe", 1), ("1f1b", 2)):
            assert zebra_chunk_tasks((3,), 4, "attention", {1}, stage, 3, W, order) == zebra_tasks_for_role(
                3, 4, "attention", {1}, stage == 2, W, wave_warmup(order, W, 3, stage))


def test_a_chunk_without_moe_layers_is_refused():
    with pytest.raises(ValueError, match=r"every model chunk needs an MoE layer for zebra .* the chunks hold \[1, 0\]"):
        zebra_chunk_tasks((1, 0), 2, "attention", (), 0, 2)
    with pytest.raises(ValueError, match="model chunks need pipeline stages"):
        zebra_chunk_tasks((1, 1), 2, "attention", (), 0, 1)
