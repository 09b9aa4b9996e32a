"""The training loop both trainers run: Megatron EP (training/megatron_ep.py) and HeterMoE
(training/hetero.py) differ in how a rank runs forward/backward and finishes its gradients,
not in the loop around them. A `RoleStep` is that difference; `train_loop` is the rest:
checkpoint resume, NaN guard, pinned parameters, the optimizer and LR steps, Megatron's skipped
iteration, the token-weighted lm loss, emulation clock, logging and checkpoint saves."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_hetermoe.config import TrainConfig
from megatron_hetermoe.parallel import watchdog
from megatron_hetermoe.reliability import faults
from megatron_hetermoe.training.step import loss_scale_of


class RoleStep(Protocol):
    def before_step(self, it: int) -> None:
        """Before the step's clock starts: load pinned parameters, record parameters."""

    def forward_backward(self, it: int) -> list[torch.Tensor]:
        """Run the step's microbatches. Returns the loss values the NaN guard checks."""

    def local_loss(self) -> torch.Tensor:
        """This rank's [token-summed loss, tokens] of the step (zeros where it computes no
        loss), read after the NaN guard (a test injects its NaN into the checked values)."""

    def before_optimizer(self) -> float | None:
        """Finish the gradients (global norm and clip where the rank owns that); return the norm
        it computed (of the unscaled gradients), or None when Megatron's optimizer computes it."""


@dataclass
class LoopParts:
    """What the loop drives, built by a trainer for its role."""
    cfg: TrainConfig
    model: object  # Megatron DDP
    optimizer: object
    scheduler: object
    guard: object  # training.nan_check.NanGuard
    recorder: object  # tools.timeline.TimelineRecorder
    steplog: object  # training.logging.StepLogger
    checkpointer: object  # checkpoint.hooks.Checkpointer
    loss_group: object  # every rank: the lm loss is summed over it
    clock: object | None = None  # emulation.EmulationClock
    # Called with the finished iteration after its log line, before its checkpoint save: a live
    # move (training/replan.py) replaces model, optimizer, scheduler, guard and the checkpointer's
    # state here, so the loop reads them from these parts each step.
    after_step: object | None = None


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    start_iteration: int = 0
    loss_scales: list[float] = field(default_factory=list)  # after each step (1.0 without a grad scaler)
    overflow_skipped: list[int] = field(default_factory=list)  # iterations the grad scaler skipped
    grad_norms: list = field(default_factory=list)  # each step's logged grad norm (None: skipped step)


def train_loop(parts: LoopParts, role: RoleStep) -> LoopResult:
    cfg, clock = parts.cfg, parts.clock
    res = LoopResult(start_iteration=parts.checkpointer.resume())
    watchdog.report(res.start_iteration)  # the launcher's progress watchdog: this rank is alive and stepping
    for it in range(res.start_iteration, cfg.train_iters):
        faults.iteration(it)  # $HETERMOE_INJECT_FAULT's site "iteration" (tests of lost ranks)
        optimizer = parts.optimizer  # a live move may have replaced it (after_step)
        parts.guard.start(it)  # a resumed run starts past 0
        role.before_step(it)
        t0 = time.perf_counter()
        if clock is not None:
            clock.step_begin(it, t0)
        parts.recorder.step = it
        parts.model.zero_grad_buffer()
        optimizer.zero_grad()
        checked = role.forward_backward(it)
        skip = parts.guard.after_backward(it, checked)  # every rank agrees
        tot = role.local_loss()
        grad_norm = role.before_optimizer()
        lr_used = optimizer.param_groups[0]["lr"]
        overflow = False
        if not skip:  # Megatron's skipped iteration: no update, no LR step
            ok, step_norm, _ = optimizer.step()
            overflow = not ok  # the grad scaler found an inf on some rank: every rank skips (step.py)
            if ok:
                parts.scheduler.step(increment=1)
                if grad_norm is None:  # the role left the norm to Megatron's optimizer
                    grad_norm = step_norm
            else:
                res.overflow_skipped.append(it)
                grad_norm = None  # as Megatron reports a skipped step
        if clock is not None:  # gradient all-reduce + optimizer on the emulated GPUs
            clock.post_step()
        # lm loss: token-weighted over microbatches and data-parallel ranks.
        dist.all_reduce(tot, group=parts.loss_group)
        loss = (tot[0] / tot[1]).item()
        res.losses.append(loss)
        res.step_times.append(time.perf_counter() - t0)
        if clock is not None:
            clock.step_end(it, res.step_times[-1])
        res.loss_scales.append(loss_scale_of(optimizer))
        if cfg.loss_log and parts.steplog.first:
            with open(cfg.loss_log, "a") as f:  # repr: the float exactly, for bitwise comparisons
                f.write(f'{{"iteration": {it + 1}, "lm loss": {loss!r}, "time": {time.time()!r}}}\n')
        res.grad_norms.append(grad_norm)
        parts.steplog.log(it + 1, res.step_times[-1], lr_used, loss, grad_norm,
                          loss_scale=None if cfg.precision == "fp32" else res.loss_scales[-1],
                          skipped=int(skip or overflow))
        watchdog.report(it + 1)
        if parts.after_step is not None:
            parts.after_step(it + 1)
        parts.checkpointer.after_step(it + 1)
        watchdog.report(it + 1)  # a save is progress too
    parts.checkpointer.finish(max(res.start_iteration, cfg.train_iters))
    return res
