"""Schedules for HeterMoE ranks, with megatron-core's forward_backward keyword signature.

`get_forward_backward_func(hs, schedule)` replaces megatron-core's getter: on an attention
rank it returns Megatron's own schedule for "distep" (HeteroMoELayer ships tokens from inside
MoELayer.forward) and `forward_backward_zebra` for "zebra"; on an expert rank it returns the
loop that mirrors the attention ranks' order of collectives for either schedule.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from megatron_hetermoe.config import ZebraConfig
from megatron_hetermoe.models.builder import unwrap
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.schedules.distep import expert_distep
from megatron_hetermoe.schedules.tasks import distep_tasks, zebra_tasks
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.schedules.zebra import AttentionZebra, ExpertZebra

TASK_LISTS = {"zebra": zebra_tasks, "distep": distep_tasks}


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
                           hetero_state: HeteroParallelState, zebra_config: ZebraConfig | None = None,
                           recorder: TimelineRecorder | None = None, executed: list | None = None,
                           schedule: str = "zebra"):
    """One step on an attention rank executing a task list: zebra (Theorem 1's order) or, for
    emulated timing, the DistEP list, over R = num_microbatches (the plan's R, or fewer while
    Megatron's --rampup-batch-size grows the batch: the expert ranks get the same count)."""
    hs = hetero_state
    if forward_only or collect_non_loss_data:
        raise NotImplementedError("forward-only passes are not supported by the zebra schedule yet; "
                                  "evaluate with --hetero-schedule distep")
    gpt = unwrap(model)
    cfg = gpt.config
    with _forward_backward_timer(cfg):
        cap = _CaptureModel()
        loss_funcs = []
        for _ in range(num_microbatches):
            _, lf = forward_step_func(data_iterator, cap)
            loss_funcs.append(lf)
        az = AttentionZebra(gpt, hs, zebra_config or ZebraConfig(), recorder)
        reported = az.run(cap.calls, loss_funcs, TASK_LISTS[schedule](hs.plan, hs.rank, num_microbatches))
        if executed is not None:
            executed.append((az.ex.executed, az.ex.executed_streams, az.ex.meter.peak))
        if cfg.finalize_model_grads_func is not None:
            cfg.finalize_model_grads_func(model if isinstance(model, list) else [model], None,
                                          pg_collection=pg_collection)
    return reported


def expert_forward_backward(*, forward_step_func=None, data_iterator=None, model, num_microbatches: int,
                            seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
                            hetero_state: HeteroParallelState, schedule: str, zebra_config: ZebraConfig | None = None,
                            recorder: TimelineRecorder | None = None, executed: list | None = None,
                            task_list: bool = False, **unused):
    """An expert rank's step: mirror the attention ranks, then reduce expert gradients over the
    expert replica group."""
    hs = hetero_state
    runtime = unwrap(model)
    if forward_only:
        if schedule != "distep" or task_list:
            raise NotImplementedError("forward-only passes run the distep schedule; zebra has no forward-only order")
        expert_distep(runtime, num_microbatches, forward_only=True)
        return []
    ddp = model[0] if isinstance(model, list) else model
    with _forward_backward_timer(runtime.config):
        if schedule == "zebra" or task_list:
            ez = ExpertZebra(runtime, hs, zebra_config or ZebraConfig(), recorder)
            ez.run(TASK_LISTS[schedule](hs.plan, hs.rank, num_microbatches))
            if executed is not None:
                executed.append((ez.ex.executed, ez.ex.executed_streams, ez.ex.meter.peak))
        else:
            expert_distep(runtime, num_microbatches)
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


def get_forward_backward_func(hs: HeteroParallelState, schedule: str | None = None, task_list: bool = False,
                              **runtime_kwargs):
    """The schedule for this rank: Megatron's own (attention, distep), zebra (attention, zebra),
    or the expert mirror (expert ranks). task_list=True runs DistEP from its task list too (used
    when emulating, so both schedules are timed by the same executor)."""
    schedule = schedule or hs.plan.schedule
    if schedule not in ("distep", "zebra"):
        raise ValueError(f"unknown hetero schedule {schedule!r}; use distep or zebra")
    if hs.role == "expert":
        return partial(expert_forward_backward, hetero_state=hs, schedule=schedule, task_list=task_list,
                       **runtime_kwargs)
    if schedule == "zebra" or task_list:
        return partial(forward_backward_zebra, hetero_state=hs, schedule=schedule, **runtime_kwargs)
    from megatron.core.pipeline_parallel import (
        get_forward_backward_func as megatron_get,
    )

    return megatron_get(pp_size=1, vp_size=None)
