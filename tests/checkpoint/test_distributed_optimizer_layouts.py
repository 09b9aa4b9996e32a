"""The plugin's own trainer (`hetermoe train`) with Megatron's distributed optimizer at pipeline size 2
(issue 42 item 4; the layouts its trainer runs: no virtual stages, no MTP): a Megatron EP checkpoint
(its baseline trainer, PP 2 x EP 2) continues as a HeterMoE run of 2 stages under zebra and distep,
parameters and Adam moments moved by name (--hetero-ckpt-reshard) from the data-parallel ranks' shards;
that run's checkpoint resumes bitwise and goes back into Megatron EP the same way. Before, a
distributed optimizer's Adam state could not be read by name: either direction was refused."""
from __future__ import annotations

import dataclasses

import pytest
from margins import within

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.tools.parity import FREE_RUN_LOSS_TOL, max_rel_loss_diff

pytestmark = pytest.mark.slow
STEPS, AT, MID = 6, 2, 4  # iterations: every run's last; the Megatron EP checkpoint HeterMoE continues; the
# HeterMoE checkpoint resumed and moved back (2 iterations after it: the second steps with its moments)


def _rank(rank: int, world: int, cfg: TrainConfig, plan, schedule: str | None):
    from megatron_hetermoe.training.hetero import train_hetero
    from megatron_hetermoe.training.megatron_ep import train

    return train(cfg) if plan is None else train_hetero(cfg, plan, HeteroRunConfig(schedule=schedule))


def _run(cfg: TrainConfig, plan=None, schedule: str | None = None):
    return launch(_rank, plan.world_size if plan else 4, cfg, plan, schedule, timeout_s=240)[0]


@pytest.fixture(scope="module")
def megatron_ep(tiny, tmp_path_factory):
    """Megatron EP (baseline trainer, PP 2 x EP 2 on 4 ranks, distributed optimizer) over STEPS
    iterations, saving every AT."""
    d = tmp_path_factory.mktemp("ep")
    cfg = TrainConfig(tiny, ParallelConfig(pp=2, ep=2), micro_batch_size=2, global_batch_size=8, train_iters=STEPS,
                      deterministic=True, quiet=True, use_distributed_optimizer=True, save=str(d),
                      save_interval=AT)
    return cfg, _run(cfg).losses, d


@pytest.mark.parametrize("schedule", ["zebra", "distep"])
def test_distributed_optimizer_checkpoints_both_ways_and_resume(tiny, megatron_ep, tmp_path, schedule):
    ep_cfg, ep_losses, ep_dir = megatron_ep
    plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 1, num_microbatches=4, pipeline_stages=2,
                     schedule=schedule)
    saved = tmp_path / "hetero"
    cfg = dataclasses.replace(ep_cfg, parallel=ParallelConfig(pp=2), save=str(saved), load=str(ep_dir),
                              ckpt_step=AT, ckpt_reshard=True)
    # Megatron EP -> HeterMoE: its parameters and its distributed optimizer's Adam moments by name.
    into = _run(cfg, plan, schedule)
    assert into.start_iteration == AT
    # Free-running (another layout sums in another order).
    within(f"{schedule}: HeterMoE from Megatron EP's checkpoint vs Megatron EP",
           max_rel_loss_diff(into.losses, ep_losses[AT:]), FREE_RUN_LOSS_TOL)
    # save -> resume at the same plan: bitwise (its checkpoint of iteration MID, optimizer and RNG).
    again = _run(dataclasses.replace(cfg, save=None, load=str(saved), ckpt_step=MID, ckpt_reshard=False), plan,
                 schedule)
    assert again.start_iteration == MID and again.losses == into.losses[MID - AT:]
    # HeterMoE -> Megatron EP: its iteration-MID checkpoint by name into the baseline trainer.
    back = _run(dataclasses.replace(ep_cfg, save=None, load=str(saved), ckpt_step=MID, ckpt_reshard=True))
    assert back.start_iteration == MID
    within(f"{schedule}: Megatron EP from HeterMoE's checkpoint vs HeterMoE",
           max_rel_loss_diff(back.losses, into.losses[MID - AT:]), FREE_RUN_LOSS_TOL)
