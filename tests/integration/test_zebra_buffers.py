"""Zebra keeps a transferred buffer only until its last consumer (issue 43 item 9): a received
buffer goes once the compute task that reads it ran, a sent gradient once its transfer was issued;
at the end of a step no slot holds one. What stays alive per microbatch is what autograd keeps,
which is what the planner's memory model counts (cost_model.expert_kept_bytes_per_token, the
attention ranks' activations), not a copy of every transfer."""
from __future__ import annotations

import pytest
from shared_plans import sparse_asym_ea_plan

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch

pytestmark = pytest.mark.slow

FIELDS = ("recv_tokens", "recv_combined", "recv_grad", "grad_permuted", "grad_combined", "grad_recv")


def _train(rank, world, cfg, plan, issuer):
    from megatron_hetermoe.schedules import zebra
    from megatron_hetermoe.training.hetero import train_hetero

    seen = {"late": [], "at_end": [], "most": 0}
    execute = zebra.ZebraRank.execute

    def checked(self, tasks, compute, stage_io=None):
        def after(t):
            compute(t)
            s, j = t.layer, t.microbatch
            late = []
            if t.kind in ("E_F", "X_F"):
                late.append((t, "recv_tokens", self.slot(s, j).recv_tokens))
            if t.kind in ("E_B", "X_B"):
                late.append((t, "recv_grad", self.slot(s, j).recv_grad))
            if t.kind == "A_F" and s > 0:
                late.append((t, "recv_combined", self.slot(s - 1, j).recv_combined))
            if t.kind == "A_B" and (s, j) in self.slots:
                late.append((t, "grad_permuted", self.slot(s, j).grad_permuted))
            seen["late"] += [(repr(t), f) for t, f, v in late if v is not None]
            held = sum(getattr(st, f) is not None for st in self.slots.values() for f in FIELDS)
            seen["most"] = max(seen["most"], held)

        run = self.ex.run

        def run_and_look(*a, **k):
            run(*a, **k)
            seen["at_end"] += [(key, f) for key, st in self.slots.items() for f in FIELDS
                               if getattr(st, f) is not None]

        self.ex.run = run_and_look
        try:
            return execute(self, tasks, after, stage_io)
        finally:
            del self.ex.run

    zebra.ZebraRank.execute = checked
    train_hetero(cfg, plan, HeteroRunConfig(zebra_issuer=issuer))
    return seen


@pytest.mark.parametrize("issuer", ["threads", "single"])
def test_transferred_buffers_go_after_their_last_consumer(tiny, issuer):
    plan = sparse_asym_ea_plan("zebra")  # Asym-EA (X tasks), an expert rank holding nothing in a layer
    plan.num_microbatches = 4
    cfg = TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=8, train_iters=2, quiet=True)
    seen = launch(_train, plan.world_size, cfg, plan, issuer)
    for rank, s in enumerate(seen):
        assert not s["late"], (rank, s["late"][:5])
        assert not s["at_end"], (rank, s["at_end"][:5])
    # a transfer's buffer lives from its transfer to its consumer: far fewer than the 6 x L x R
    # (6 x 2 x 4 = 48) fields a step used to keep on each rank to its end
    assert max(s["most"] for s in seen) <= 16, [s["most"] for s in seen]
    print(f"most transfer buffers held at once per rank: {[s['most'] for s in seen]}")
