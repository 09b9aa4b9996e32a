"""No hangs: a rank that raises or dies mid-step, on either side, forward or backward, under
DistEP or zebra, makes every other rank exit non-zero by itself within a bounded time, and the
job reports the dead rank and its error."""
import random

import pytest

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import LaunchError, launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.reliability.faults import ENV, Fault
from megatron_hetermoe.training.hetero import train_hetero

pytestmark = pytest.mark.slow
BOUND_S = 60.0  # the bound on CPU


def _train(rank, world, cfg, plan, schedule):
    return train_hetero(cfg, plan, HeteroRunConfig(schedule=schedule))


def _injections() -> list[tuple[str, Fault]]:
    # Per rank and step (L=2 layers, R=2 microbatches, 2 steps): 40 exchanges (counts, tokens,
    # combine, and the two gradient exchanges per layer and microbatch), 24 compute tasks on an
    # attention rank and 16 on an expert rank (zebra and emulated DistEP run task lists).
    rng = random.Random(20261129)
    out = []
    for i in range(24):
        schedule = ("distep", "zebra")[i % 2]
        rank = rng.randrange(4)  # ranks 0-1 attention, 2-3 experts
        site = "task" if schedule == "zebra" and rng.random() < 0.5 else "exchange"
        at = rng.randrange(16 if site == "task" else 40)
        out.append((schedule, Fault(rank, site, at, rng.choice(["raise", "exit"]))))
    return out


@pytest.mark.parametrize("schedule, fault", _injections(), ids=lambda x: x if isinstance(x, str) else x.env())
def test_injected_fault_ends_every_rank(tiny, schedule, fault, monkeypatch):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule=schedule)
    cfg = TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=4, train_iters=2, quiet=True)
    monkeypatch.setenv(ENV, fault.env())
    with pytest.raises(LaunchError) as e:
        launch(_train, 4, cfg, plan, schedule, timeout_s=120, collective_timeout_s=BOUND_S, peer_grace_s=BOUND_S)
    err = e.value
    assert err.rank == fault.rank, str(err)[:2000]
    if fault.mode == "raise":
        assert "injected fault on rank" in str(err)
    else:
        assert "exited with code 17" in str(err)
    assert err.killed == [], f"ranks {err.killed} were still running {BOUND_S} s after the failure"
    assert set(err.peer_exit_s) == set(range(4)) - {fault.rank}
    assert max(err.peer_exit_s.values()) < BOUND_S
