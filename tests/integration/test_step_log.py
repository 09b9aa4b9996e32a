"""Megatron-style logging: iteration lines with per-role utilization and TensorBoard scalars."""
import pytest

from megatron_hetermoe.config import ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.training.hetero import train_hetero


def _train(rank, world, cfg, plan):
    return train_hetero(cfg, plan)


@pytest.mark.slow
def test_tensorboard_scalars_and_role_utilization(tiny, tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 1, num_microbatches=2, schedule="zebra")
    cfg = TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=2, train_iters=4,
                      log_interval=2, tensorboard_dir=str(tmp_path))
    res = launch(_train, 2, cfg, plan)[0]
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if "iteration" in line]
    assert len(lines) == 2 and all("utilization: attention" in line and "expert" in line for line in lines), out
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()
    assert ({"lm loss", "learning-rate", "grad-norm", "utilization/attention", "utilization/expert"}
            <= set(ea.Tags()["scalars"]))
    logged = {e.step: e.value for e in ea.Scalars("lm loss")}
    assert logged == pytest.approx({2: res.losses[1], 4: res.losses[3]})
    assert res.peak_gpu_mib is None and len(res.peak_rss_mib) == 2  # CPU ranks: no GPU memory report
