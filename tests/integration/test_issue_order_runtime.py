"""What the single issuer really issued, traced on CPU ranks (reliability/collective_trace.py), runs
to its end on the worst GPU (issue 43 items 1 and 2): every rank's calls in the order it entered
them, one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), each call blocking until its members (a
collective) or its counterparts (point to point, NCCL's large messages) are there
(`single_queue_hangs`). Gloo buffers sends and runs communicators side by side, so on CPU both
orders train; only the trace shows which one would hang on a GPU."""
from __future__ import annotations

import pytest
from shared_plans import sparse_asym_ea_plan

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.reliability import collective_trace

pytestmark = pytest.mark.slow


def _train(rank, world, cfg, plan):
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, HeteroRunConfig(zebra_issuer="single")).losses


def _cfg(tiny, plan, steps: int = 2) -> TrainConfig:
    members = len(plan.attention_ranks) // (plan.attention_tp * plan.pipeline_stages)
    return TrainConfig(tiny, ParallelConfig(pp=plan.pipeline_stages), micro_batch_size=1,
                       global_batch_size=plan.num_microbatches * members, train_iters=steps, quiet=True)


def _pp2_1f1b(tiny):
    # one MoE layer per stage, 4 waves of one microbatch in 1F1B's order: stage 0 sends P_F(0,1) and
    # receives P_B(1,0) while stage 1 sends P_B(1,0) and receives P_F(0,1) (the crossing of item 1)
    return even_plan(tiny.num_layers, tiny.num_experts, 1, 1, num_microbatches=4, schedule="zebra",
                     pipeline_stages=2, zebra_waves=4, zebra_wave_order="1f1b")


def _unbatched(self, call):
    """The runtime before issue 43: each pipeline message posted alone, a send right after the
    task that made it, a receive right before the task that reads it."""
    from megatron_hetermoe.plan.issue_order import PipeCall

    for m in sorted(call.messages, key=lambda m: not m.send):
        _posted_alone(self, PipeCall(m.peer, (m,)))


_posted_alone = None


@pytest.mark.parametrize("batched", [True, False])
def test_pipeline_stages_in_1f1b_waves_would_not_hang_a_gpu(tiny, tmp_path, monkeypatch, batched):
    global _posted_alone
    from megatron_hetermoe.schedules import zebra

    monkeypatch.setenv(collective_trace.ENV, str(tmp_path))
    if not batched:
        _posted_alone = zebra._PipelineNeighbours.issue
        monkeypatch.setattr(zebra._PipelineNeighbours, "issue", _unbatched)
    plan = _pp2_1f1b(tiny)
    launch(_train, plan.world_size, _cfg(tiny, plan), plan)
    assert collective_trace.check(tmp_path) == []  # every group's members agree (gloo ran it through)
    hangs = collective_trace.single_queue_hangs(tmp_path)
    if batched:
        assert hangs == []
    else:  # the crossing: each stage's attention rank (0, 2) waits in its send, the other's receive
        # queued behind the other's send; their expert ranks wait in a dispatch behind them
        sends = [h for h in hangs if "batch_isend_irecv" in h]
        assert [h.split()[1] for h in sends] == ["0", "2"] and all("'send'" in h for h in sends), hangs


def test_asym_ea_two_attention_ranks_would_not_hang_a_gpu(tiny, tmp_path, monkeypatch):
    """Dispatch, combine and counts communicators, collectives inside attention pieces (the global
    aux loss over the attention ranks), X tasks on one attention rank only, an expert rank holding
    nothing in a layer: one order the worst device can run."""
    monkeypatch.setenv(collective_trace.ENV, str(tmp_path))
    plan = sparse_asym_ea_plan("zebra")
    launch(_train, plan.world_size, _cfg(tiny, plan), plan)
    assert collective_trace.check(tmp_path) == []
    assert collective_trace.single_queue_hangs(tmp_path) == []
