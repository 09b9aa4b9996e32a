"""Expert loads in a run's log, the same in both hostings (the plugin's trainer: training/logging.py;
Megatron-LM's pretrain(): megatron_lm/hooks.py): at each log interval one all-reduce of the
interval's tokens per (layer, expert) and each rank's compute seconds per task kind
(parallel/expert_load.py), then
- the iteration line's "expert load max/mean" (the worst layer's most loaded expert over the
  layer's mean, over the interval);
- TensorBoard / W&B scalars named as Megatron names its MoE metrics (moe_utils.track_moe_metrics):
  "expert_load_max_over_mean" (the worst layer), and per layer "moe/expert_load_max_over_mean_layer_{i}"
  plus, per expert, "moe/expert_tokens_layer_{i}_expert_{e}" where per-layer logging is on
  (Megatron-LM's --moe-per-layer-logging; the plugin's trainer: always);
- the stats file (planner/expert_load.py's format) written by the first rank.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_hetermoe.parallel.device import rank_device
from megatron_hetermoe.parallel.expert_load import ExpertLoadMeter, new_stats
from megatron_hetermoe.planner.expert_load import ExpertLoad

STATS_FILE = "expert_load.json"  # its name beside a timeline (hetermoe timeline reads it there)


def stats_path(run) -> str | None:
    """Where a run writes its stats file: --hetero-expert-load-stats, else beside its timeline."""
    if run.expert_load_stats:
        return run.expert_load_stats
    return str(Path(run.timeline_dir) / STATS_FILE) if run.timeline_dir else None


class ExpertLoadLog:
    """A rank's expert-load logging: install() puts a meter on its HeteroParallelState."""

    def __init__(self, hs, roles: list[str], path: str | None, recorder=None, writes: bool = False):
        """`roles`: every rank's; `recorder`: the rank's TimelineRecorder (task seconds; None: tokens
        only); `writes`: this rank writes the stats file."""
        self.hs, self.path, self.recorder, self.writes = hs, path, recorder, writes
        self.meter = ExpertLoadMeter(hs.plan.num_layers, hs.plan.num_experts)
        self.stats = new_stats(hs.plan, roles)
        self.last: ExpertLoad | None = None  # the last interval's
        self.reduced_at: int | None = None  # the iteration the last interval ended at
        hs.load_meter = self.meter

    def step(self, iteration: int) -> None:
        """After each training step (`iteration`: 1-based, the one logged): its task seconds."""
        by_kind = self.recorder.kind_seconds(iteration - 1) if self.recorder is not None else {}
        self.meter.add_seconds(iteration, by_kind)

    def interval(self, iteration: int) -> ExpertLoad:
        """Collective over the world: the interval ending at `iteration`; writes the stats file."""
        tokens = self.meter.reduce_into(self.stats, iteration, self.hs.group("world"), self.hs.device)
        self.reduced_at = iteration
        self.last = ExpertLoad.of(tokens)
        if self.writes and self.path:
            self.stats.save(self.path)
        return self.last

    @staticmethod
    def line(load: ExpertLoad) -> str:
        mm = load.max_over_mean()
        if not mm or not any(sum(r) for r in load.tokens):
            return ""
        worst = max(range(len(mm)), key=mm.__getitem__)
        return f" expert load max/mean: {mm[worst]:.2f} (layer {worst}) |"

    @staticmethod
    def write_scalars(load: ExpertLoad, iteration: int, writer=None, wandb_writer=None,
                      per_layer: bool = True) -> None:
        mm = load.max_over_mean()
        if not mm:
            return
        scalars = {"expert_load_max_over_mean": max(mm)}
        if per_layer:
            for i, v in enumerate(mm):
                scalars[f"moe/expert_load_max_over_mean_layer_{i}"] = v
                for e, t in enumerate(load.tokens[i]):
                    scalars[f"moe/expert_tokens_layer_{i}_expert_{e}"] = t
        if writer is not None:
            for k, v in scalars.items():
                writer.add_scalar(k, v, iteration)
        if wandb_writer is not None:
            wandb_writer.log(scalars, iteration)

    def total_loss_entry(self, load: ExpertLoad, total_loss_dict: dict, advanced: int) -> None:
        """Megatron-LM's training_log prints each total_loss_dict entry as its sum over the
        interval's advanced iterations divided by their count: the interval's value times that
        count prints the value."""
        mm = load.max_over_mean()
        if mm:
            # on the rank's device, as Megatron-LM's training_log keeps its other entries
            total_loss_dict["expert load max/mean"] = torch.tensor([max(mm) * max(1, advanced)],
                                                                   device=rank_device())
