"""Per-iteration logging as Megatron does it: the iteration line on the first rank, TensorBoard
scalars (--tensorboard-dir, Megatron's names), and per-role utilization (busy compute over step
time, from each rank's timeline) when the ranks record compute tasks (zebra, emulated runs).
Busy time is TimelineRecorder.busy: on a CUDA rank running a task list, the compute tasks' CUDA
event spans (when they ran on the GPU); on CPU ranks and emulated runs, host times. Megatron's own
schedule (DistEP attention ranks without emulation, the Megatron EP trainer) records no tasks.
Expert loads (training/expert_load_log.py): the interval's max/mean on the line, TensorBoard
scalars, the stats file. `log` is collective over `group`: every rank calls it at the same
iterations."""
from __future__ import annotations

import torch.distributed as dist

from megatron_hetermoe.config import TrainConfig


def format_iteration(it: int, cfg: TrainConfig, dt: float, lr, loss: float, grad_norm,
                     loss_scale: float | None = None, skipped: int = 0) -> str:
    """A Megatron-style iteration line; with `loss_scale` (bf16/fp16 runs) also Megatron's loss
    scale and skipped-iteration fields."""
    tokens = cfg.global_batch_size * cfg.model.seq_length
    gn = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
    scale = f"loss scale: {loss_scale:.1f} | " if loss_scale is not None else ""
    tail = f" number of skipped iterations: {skipped:3d} |" if loss_scale is not None else ""
    bar = ""
    if cfg.progress_bar:
        done = round(20 * it / cfg.train_iters)
        bar = f"[{'#' * done}{'.' * (20 - done)}] "
    return (bar + f" iteration {it:>8}/{cfg.train_iters:>8} | consumed samples: {it * cfg.global_batch_size:>10} | "
            f"elapsed time per iteration (ms): {dt * 1000:.1f} | tokens/s: {tokens / dt:.0f} | "
            f"learning rate: {lr:.6E} | global batch size: {cfg.global_batch_size:>5} | "
            f"lm loss: {loss:.6E} | {scale}grad norm: {gn} |" + tail)


def last_step_busy(recorder, step: int, group) -> list[float]:
    """Seconds each rank spent in (emulated) compute during `step`, from its timeline (on the
    GPU where the rank recorded CUDA spans: TimelineRecorder.busy)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, recorder.busy(step), group=group)
    return out


class StepLogger:
    def __init__(self, cfg, role: str, recorder, group, is_first_rank: bool, load=None):
        """`load`: the run's expert-load logging (training/expert_load_log.ExpertLoadLog; None:
        none, the Megatron EP trainer)."""
        self.cfg, self.role, self.recorder, self.group = cfg, role, recorder, group
        self.load = load
        self.first = is_first_rank
        self.skipped = 0
        self.tb = None
        if cfg.tensorboard_dir and is_first_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(f"--tensorboard-dir {cfg.tensorboard_dir} needs the tensorboard package "
                                   f"(pip install tensorboard): {e}") from None
            self.tb = SummaryWriter(cfg.tensorboard_dir)

    def utilization(self, step: int, dt: float) -> dict[str, float]:
        got = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(got, (self.role, self.recorder.busy(step)), group=self.group)
        by: dict[str, list[float]] = {}
        for role, b in got:
            by.setdefault(role, []).append(b)
        if not any(b for v in by.values() for b in v):
            return {}  # nothing recorded (Megatron's own schedule without emulation)
        # busy compute / step time; never above 1 (compute tasks of a rank do not overlap: one
        # thread on the host, one stream on the GPU)
        return {r: min(1.0, sum(v) / len(v) / dt) for r, v in by.items()}

    def log(self, it: int, dt: float, lr: float, loss: float, grad_norm, loss_scale: float | None = None,
            skipped: int = 0) -> None:
        self.skipped += skipped  # Megatron's count: skipped iterations since the last line
        load = None
        if self.load is not None:
            self.load.step(it)
            # the interval's one collective: where the line is printed or a stats file is written
            if not it % self.cfg.log_interval and (not self.cfg.quiet or self.load.path):
                load = self.load.interval(it)
        if self.cfg.quiet or it % self.cfg.log_interval:
            return
        skipped, self.skipped = self.skipped, 0
        util = self.utilization(it - 1, dt)
        if not self.first:
            return
        line = format_iteration(it, self.cfg, dt, lr, loss, grad_norm, loss_scale, skipped)
        if util:
            line += " utilization: " + " ".join(f"{r} {u:.0%}" for r, u in sorted(util.items())) + " |"
        if load is not None:
            line += self.load.line(load)
        print(line, flush=True)
        if self.tb is not None:
            tokens = self.cfg.global_batch_size * self.cfg.model.seq_length
            self.tb.add_scalar("lm loss", loss, it)
            self.tb.add_scalar("learning-rate", lr, it)
            if grad_norm is not None:
                self.tb.add_scalar("grad-norm", grad_norm, it)
            if loss_scale is not None:
                self.tb.add_scalar("loss-scale", loss_scale, it)
            self.tb.add_scalar("iteration-time", dt, it)
            self.tb.add_scalar("throughput (tokens/s)", tokens / dt, it)
            for r, u in util.items():
                self.tb.add_scalar(f"utilization/{r}", u, it)
            if load is not None:
                self.load.write_scalars(load, it, self.tb)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
