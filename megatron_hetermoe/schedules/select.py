"""Schedules for HeterMoE ranks, with megatron-core's forward_backward keyword signature.

`get_forward_backward_func(hs, run)` replaces megatron-core's getter. What runs is decided in
one place, `runs_task_list`: a schedule whose attention ranks run Megatron's own schedule
(DistEP: HeteroMoELayer ships tokens from inside MoELayer.forward, plan.tasks.SCHEDULES) does so
unless its tasks are timed (an emulated run: Megatron's schedule cannot be timed task by task),
in which case both roles execute its task list on the zebra executor; zebra always does. On an
expert rank it returns the loop that mirrors the attention ranks' order of collectives.
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from functools import partial
from typing import Callable

from megatron_hetermoe.config import HeteroRunConfig
from megatron_hetermoe.models.builder import unwrap
from megatron_hetermoe.parallel.extension import TaskTiming
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.plan.tasks import Task
from megatron_hetermoe.plan.tasks import schedule as schedule_named
from megatron_hetermoe.schedules.distep import ExpertSpans, expert_distep
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.schedules.zebra import AttentionZebra, ExpertZebra, ZebraRank
from megatron_hetermoe.vocabulary import Role, ScheduleName


class ExecutedSteps(collections.deque):
    """Where task-list steps report what they ran: (compute order, {stream: transfers},
    activation peak in bytes, None for an unmetered step) per step, the last `maxlen` kept.
    `meter`: whether the next step meters its saved activations (ActivationMeter: a finalizer per
    saved tensor, so only for a step whose peak is read). A plain list meters every step."""

    def __init__(self, maxlen: int | None = None, meter: bool = True):
        super().__init__(maxlen=maxlen)
        self.meter = meter


def _meters(executed: list | ExecutedSteps | None) -> bool:
    return executed is not None and getattr(executed, "meter", True)


class Built:
    """What every task-list step of a run shares, made at its first step: the rank's ZebraRank
    (its executor, and the threaded executor's stream workers) and the task list of each
    microbatch count. Each step resets what is its own (executor.run, ZebraRank.execute)."""

    def __init__(self):
        self._rank: tuple[object, ZebraRank] | None = None  # (the model it runs, its ZebraRank)
        self._tasks: dict[int, list[Task]] = {}

    def rank(self, model: object, make: Callable[[], ZebraRank]) -> ZebraRank:
        """`model`'s ZebraRank: the one made for it before, else make()'s (closing the other's)."""
        if self._rank is None or self._rank[0] is not model:
            self.close()
            self._rank = (model, make())
        return self._rank[1]

    def tasks(self, schedule: str, hs: HeteroParallelState, num_microbatches: int) -> list[Task]:
        """This rank's task list of `schedule` over `num_microbatches` (the plan and rank are the run's)."""
        if num_microbatches not in self._tasks:
            self._tasks[num_microbatches] = schedule_named(schedule).tasks(hs.plan, hs.rank, num_microbatches)
        return self._tasks[num_microbatches]

    def close(self) -> None:
        """End the kept ZebraRank's stream workers (daemon threads: a process may also just exit)."""
        rank, self._rank = self._rank, None
        if rank is not None:
            rank[1].close()


def _step(zr: ZebraRank, executed: list | ExecutedSteps | None) -> ZebraRank:
    """Meter the coming step of `zr` if `executed` reads its peak."""
    zr.ex.meter.enabled = _meters(executed)
    return zr


def _report(zr: ZebraRank, executed: list | ExecutedSteps | None) -> None:
    if executed is not None:
        ex = zr.ex
        executed.append((ex.executed, ex.executed_streams, ex.meter.peak if ex.meter.enabled else None))


class _CaptureModel:
    """Stands in for the model when calling a Megatron forward_step_func, to get the
    microbatch (tokens, positions, labels, attention mask, loss mask, packed-sequence
    parameters: what GPTModel.forward takes) and its loss_func without running the model: zebra
    runs the model stage by stage itself (models/stages.py) with the same inputs. An input zebra
    has no place for is refused, never dropped."""

    vp_stage = None  # Megatron-LM's forward_step reads it (get_attr_wrapped_model)
    _PASSED = ("loss_mask", "packed_seq_params")

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, input_ids, position_ids, attention_mask=None, labels=None, **kwargs):
        other = sorted(k for k, v in kwargs.items() if v is not None and k not in self._PASSED)
        if other:
            raise NotImplementedError(f"the zebra schedule runs GPTModel stage by stage and cannot pass "
                                      f"{other} to it; use --hetero-schedule distep")
        self.calls.append({"tokens": input_ids, "position_ids": position_ids, "labels": labels,
                           "attention_mask": attention_mask,
                           **{k: kwargs.get(k) for k in self._PASSED}})
        return None


def forward_backward_zebra(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                           micro_batch_size: int, decoder_seq_length=None, forward_only: bool = False,
                           collect_non_loss_data: bool = False, first_val_step=None, adjust_tensor_shapes_fn=None,
                           p2p_communicator=None, pg_collection=None, force_all_reduce: bool = False,
                           hetero_state: HeteroParallelState, run: HeteroRunConfig, schedule: str,
                           recorder: TimelineRecorder | None = None,
                           executed: list | ExecutedSteps | None = None,
                           task_timing: TaskTiming | None = None, built: Built | None = None):
    """One step on an attention rank executing a task list: zebra (Theorem 1's order) or, for
    emulated timing, the DistEP list, over R = num_microbatches (the plan's R, or fewer while
    Megatron's --rampup-batch-size grows the batch: the expert ranks get the same count).
    `built`: what the run's steps share (get_forward_backward_func makes one per run); None:
    built for this step alone."""
    hs = hetero_state
    if forward_only or collect_non_loss_data:
        raise NotImplementedError("forward-only passes are not supported by the zebra schedule yet; "
                                  "evaluate with --hetero-schedule distep")
    chunks = model if isinstance(model, list) else [model]
    gpts = [unwrap(m) for m in chunks]
    V = hs.plan.virtual_stages
    if len(gpts) != V:
        raise ValueError(f"the zebra step got {len(gpts)} model chunk(s), the plan has virtual_stages={V}; build one "
                         f"chunk per virtual stage (--num-virtual-stages-per-pipeline-rank {V})")
    # With virtual stages Megatron-LM passes one data iterator per chunk (each chunk's forward_step
    # reads the batch of its virtual stage: Nones where it neither embeds nor computes the loss).
    iterators = data_iterator if V > 1 else [data_iterator]
    cfg = gpts[0].config
    with _forward_backward_timer(cfg):
        batches, loss_funcs = [], []
        for c in range(V):
            cap = _CaptureModel()
            cap.vp_stage = getattr(gpts[c], "vp_stage", None) if V > 1 else None
            loss_funcs.append([forward_step_func(iterators[c], cap)[1] for _ in range(num_microbatches)])
            batches.append(cap.calls)
        alone = built is None
        built = built or Built()
        az = _step(built.rank(gpts[0], lambda: AttentionZebra(gpts if V > 1 else gpts[0], hs, run, recorder,
                                                                task_timing, schedule)), executed)
        try:
            reported, num_tokens = az.run(batches if V > 1 else batches[0], loss_funcs if V > 1 else loss_funcs[0],
                                          built.tasks(schedule, hs, num_microbatches),
                                          (decoder_seq_length or seq_length, micro_batch_size))
        finally:
            if alone:
                built.close()
        _report(az, executed)
        if cfg.finalize_model_grads_func is not None:
            cfg.finalize_model_grads_func(model if isinstance(model, list) else [model],
                                          num_tokens,
                                          pg_collection=pg_collection)
    return reported


def expert_forward_backward(*, forward_step_func=None, data_iterator=None, model, num_microbatches: int,
                            seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
                            hetero_state: HeteroParallelState, run: HeteroRunConfig, schedule: str,
                            recorder: TimelineRecorder | None = None,
                            executed: list | ExecutedSteps | None = None,
                            task_timing: TaskTiming | None = None, built: Built | None = None, **unused):
    """An expert rank's step: mirror the attention ranks, then reduce expert gradients over the
    expert replica group. `built`: as forward_backward_zebra's."""
    hs = hetero_state
    runtime = unwrap(model)
    if forward_only:
        if runs_task_list(schedule, task_timing):
            raise NotImplementedError("forward-only passes run Megatron's forward (the distep mirror); a task "
                                      "list has no forward-only order")
        expert_distep(runtime, num_microbatches, forward_only=True)
        return []
    ddp = model[0] if isinstance(model, list) else model
    with _forward_backward_timer(runtime.config):
        if runs_task_list(schedule, task_timing):
            alone = built is None
            built = built or Built()
            ez = _step(built.rank(runtime, lambda: ExpertZebra(runtime, hs, run, recorder, task_timing, schedule)),
                       executed)
            try:
                ez.run(built.tasks(schedule, hs, num_microbatches))
            finally:
                if alone:
                    built.close()
            _report(ez, executed)
        else:
            spans = ExpertSpans(recorder, hs.device) if recorder is not None else None
            expert_distep(runtime, num_microbatches, spans=spans)
        ddp.finish_grad_sync()  # the expert side of Megatron's finalize_model_grads (1/M: training/hetero.py)
    return []


@contextmanager
def _forward_backward_timer(config):
    """Megatron's 'forward-backward' L1 timer around a step, as its own schedules time theirs
    (when Megatron-LM's training loop set config.timers), so every rank of every role reports it."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    yield
    timers("forward-backward").stop()


def runs_task_list(schedule: str, task_timing: TaskTiming | None) -> bool:
    """Whether `schedule`'s step executes its task list (zebra's executor) rather than Megatron's
    own schedule on the attention ranks (mirrored by the expert ranks): always for a schedule
    without a Megatron form, and for every schedule whose tasks are timed (emulation)."""
    return task_timing is not None or not schedule_named(schedule).megatron_on_attention


def get_forward_backward_func(hs: HeteroParallelState, run: HeteroRunConfig | None = None,
                              recorder: TimelineRecorder | None = None,
                              executed: list | ExecutedSteps | None = None,
                              task_timing: TaskTiming | None = None):
    """The step function of this rank for `run.schedule` (None: the plan's), with megatron-core's
    forward_backward keywords: Megatron's own schedule (attention ranks, a Megatron-form
    schedule untimed), the task-list executor (attention ranks otherwise), or the expert mirror
    (expert ranks). `recorder`/`executed` record the task lists' execution (the activation
    peak only as `executed` asks: ExecutedSteps); `task_timing` times every task (an emulated
    cluster). The task-list executor, its workers and task lists are made at the first step and
    serve every step of the returned function (`Built`)."""
    run = run or HeteroRunConfig()
    name = schedule_named(run.schedule or hs.plan.schedule).name
    kw = dict(hetero_state=hs, run=run, schedule=name, recorder=recorder, executed=executed, task_timing=task_timing,
              built=Built())
    if hs.role == Role.EXPERT:
        return partial(expert_forward_backward, **kw)
    if runs_task_list(name, task_timing):
        if hs.plan.pipeline_stages > 1 and name != ScheduleName.ZEBRA:
            raise NotImplementedError(f"{name} inside {hs.plan.pipeline_stages} pipeline stages has no task lists to "
                                      f"time (it runs Megatron's 1F1B across the stages); emulate zebra")
        return partial(forward_backward_zebra, **kw)
    from megatron.core.pipeline_parallel import (
        get_forward_backward_func as megatron_get,
    )

    P, V = hs.plan.pipeline_stages, hs.plan.virtual_stages
    if P == 1:
        return megatron_get(pp_size=1, vp_size=None)
    return _Pipelined(hs, megatron_get(pp_size=P, vp_size=V if V > 1 else None))


class _Pipelined:
    """Megatron's 1F1B (interleaved with the plan's virtual stages) on an attention rank of a
    pipeline stage, over the rank's pipeline group (member k of every stage of its ZP group) with
    an explicit P2PCommunicator: the plugin's trainer installs no parallel_state globals, and
    Megatron-LM's installs the same group."""

    def __init__(self, hs: HeteroParallelState, fn: Callable):
        self.hs, self.fn = hs, fn
        self._comm: tuple[object, object] | None = None  # (config, its P2PCommunicator)

    def __call__(self, *, model, pg_collection=None, p2p_communicator=None, **kw):
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.utils import get_model_config

        if p2p_communicator is None:
            config = get_model_config(model[0] if isinstance(model, list) else model)
            if self._comm is None or self._comm[0] is not config:
                self._comm = (config, P2PCommunicator(pp_group=self.hs.megatron_group("pp"), config=config))
            p2p_communicator = self._comm[1]
        return self.fn(model=model, p2p_communicator=p2p_communicator,
                       pg_collection=pg_collection or self.hs.pg_collection(), **kw)
