"""The order an expert rank mirrors under DistEP (schedules/distep.py): Megatron's 1F1B at its
pipeline stage, and with virtual stages Megatron's interleaved 1F1B, chunk by chunk."""
import pytest

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.schedules.distep import interleaved_order, pipeline_order


def test_interleaved_order_by_hand():
    """P 2, V 2, R 4, groups of 2 microbatches: megatron-core's table runs microbatches 0, 1 of chunk
    0, then of chunk 1, then 2, 3 likewise. Stage 0 warms up (2-0-1)*2 + (2-1)*2 = 4 forwards, stage 1
    2; backward k runs chunk V-1 - chunk(k)."""
    F, B = "F", "B"
    assert interleaved_order(4, 2, 0, 2, 2) == [(F, 0), (F, 0), (F, 1), (F, 1),
                                                (F, 0), (B, 1), (F, 0), (B, 1), (F, 1), (B, 0), (F, 1), (B, 0),
                                                (B, 1), (B, 1), (B, 0), (B, 0)]
    assert interleaved_order(4, 2, 1, 2, 2) == [(F, 0), (F, 0),
                                                (F, 1), (B, 1), (F, 1), (B, 1), (F, 0), (B, 0), (F, 0), (B, 0),
                                                (F, 1), (B, 1), (F, 1), (B, 1), (B, 0), (B, 0)]
    assert interleaved_order(4, 2, 0, 2, 2, forward_only=True) == [(F, 0), (F, 0), (F, 1), (F, 1)] * 2


@pytest.mark.parametrize("P, V, R, group", [(2, 2, 4, 2), (2, 3, 6, 2), (4, 2, 8, 4), (2, 2, 6, 3)])
def test_interleaved_order_runs_every_chunk_forward_then_backward_once_per_microbatch(P, V, R, group):
    """On every stage each chunk goes forward R times and backward R times, and no chunk goes
    backward more often than it went forward so far (its FIFO of alive microbatches never underflows)."""
    for stage in range(P):
        order = interleaved_order(R, P, stage, V, group)
        assert len(order) == 2 * R * V
        alive = [0] * V
        for step, c in order:
            alive[c] += 1 if step == "F" else -1
            assert alive[c] >= 0, (stage, order)
        assert alive == [0] * V
        assert sum(1 for s, c in order if s == "F" and c == 0) == R


def test_pipeline_order_without_virtual_stages_is_1f1b_of_chunk_0():
    plan = even_plan(4, 4, 1, 1, num_microbatches=3, pipeline_stages=2)
    assert pipeline_order(plan, 0, 3) == [("F", 0), ("F", 0), ("B", 0), ("F", 0), ("B", 0), ("B", 0)]
    assert pipeline_order(plan, 1, 3) == [("F", 0), ("B", 0)] * 3
    assert pipeline_order(plan, 0, 3, forward_only=True) == [("F", 0)] * 3
    one = even_plan(2, 4, 1, 1, num_microbatches=2)
    assert pipeline_order(one, 0, 2) == [("F", 0), ("B", 0)] * 2
    vpp = even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2)
    assert pipeline_order(vpp, 1, 4) == interleaved_order(4, 2, 1, 2, 2)  # the default group: P microbatches
