"""Plans whose expert ranks hold no expert in some layer (Asym-EA empties an expert rank's layer
whenever it moves more than E-N experts to the attention side): parity with Megatron EP under
every schedule and issuer, with M = 2 attention ranks, the second of which holds an expert."""
import pytest
from margins import within
from shared_plans import sparse_asym_ea_plan

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
from megatron_hetermoe.tools.parity import GRAD_NORM_TOL, GRAD_TOL, LOSS_TOL, run_parity

pytestmark = pytest.mark.slow


def _one_plus_two(schedule: str) -> HeteroPlan:
    """1 attention + 2 expert ranks; expert rank 2 holds nothing in layer 1."""
    g = ZPGroup([0], [1, 2], [{1: [0, 1], 2: [2, 3]}, {1: [0, 1, 2, 3]}])
    return HeteroPlan(2, 4, ["cpu"] * 3, [g], num_microbatches=2, schedule=schedule)


@pytest.mark.parametrize("schedule, issuer", [("distep", "auto"), ("zebra", "threads"), ("zebra", "single")])
@pytest.mark.parametrize("make", [_one_plus_two, sparse_asym_ea_plan], ids=["1+2", "2+2-asym-ea"])
def test_expert_rank_without_experts_in_a_layer(tiny, make, schedule, issuer):
    # Measured: the same worst values as the dense plans (loss 8.7e-8, grads 2.1e-7 on 1+2).
    r = run_parity(make(schedule), tiny, steps=2, micro_batch_size=1, free_run=False, issuer=issuer)
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)


def _train(rank, world, cfg, plan, issuer):
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, HeteroRunConfig(zebra_issuer=issuer))


@pytest.mark.parametrize("schedule, issuer", [("distep", "auto"), ("zebra", "threads"), ("zebra", "single")])
def test_plugin_trainer_enters_every_collective_in_one_order(tiny, tmp_path, monkeypatch, schedule, issuer):
    """Issue 24 item 7, on the plugin's trainer: every member of every group enters the same
    collectives in the same order, each group from one thread at a time
    (reliability/collective_trace.py)."""
    from megatron_hetermoe.config import ParallelConfig, TrainConfig
    from megatron_hetermoe.parallel.launcher import launch
    from megatron_hetermoe.reliability import collective_trace

    monkeypatch.setenv(collective_trace.ENV, str(tmp_path))
    cfg = TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=4, train_iters=2, quiet=True)
    launch(_train, 4, cfg, sparse_asym_ea_plan(schedule), issuer)
    assert len(list(tmp_path.glob("collectives.rank*.jsonl"))) == 4
    assert collective_trace.check(tmp_path) == []
