"""DistEP on an expert rank: the mirror of the Megatron schedule that the attention ranks of its
pipeline stage run with HeteroMoELayer, so both sides enter the same collectives in the same
order. Without pipeline stages that is Megatron's no-pipelining schedule (for each microbatch,
every layer forward, then every layer backward in reverse); with them, Megatron's 1F1B
(forward_backward_pipelining_without_interleaving) at this rank's stage: its warm-up forwards,
then one forward and one backward at a time, then the cool-down backwards, each over the stage's
layers only; with virtual stages, Megatron's interleaved 1F1B
(forward_backward_pipelining_with_interleaving), each forward and backward over one model chunk's
layers, in the order megatron-core's own schedule table gives."""
from __future__ import annotations

import collections
import time
from typing import Callable

import torch

from megatron_hetermoe.plan.tasks import Task
from megatron_hetermoe.schedules.executor import CudaTiming
from megatron_hetermoe.vocabulary import TaskKind


def one_f_one_b(num_microbatches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """The order of microbatch forwards ("F", i) and backwards ("B", i) that Megatron's
    non-interleaved 1F1B runs at pipeline stage `stage` of `stages`: min(stages - stage - 1, R)
    warm-up forwards, then forward/backward pairs, then the remaining backwards (first in, first out)."""
    R = num_microbatches
    warmup = min(stages - stage - 1, R)
    order = [("F", i) for i in range(warmup)]
    for i in range(R - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(R - warmup, R)]
    return order


def interleaved_order(num_microbatches: int, stages: int, stage: int, chunks: int, group_size: int,
                      forward_only: bool = False) -> list[tuple[str, int]]:
    """The order of model-chunk forwards ("F", chunk) and backwards ("B", chunk) that Megatron's
    interleaved 1F1B runs at pipeline stage `stage` of `stages` with `chunks` model chunks a stage
    and config.microbatch_group_size_per_vp_stage `group_size`: megatron-core's own schedule table
    and warm-up count (get_schedule_table, get_pp_rank_microbatches), then forward k + warm-up
    and backward k in turn. A chunk's microbatches go backward in the order they went forward."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )

    pp = SimpleNamespace(size=lambda: stages, rank=lambda: stage)
    comm = SimpleNamespace(pp_group=pp, virtual_pipeline_model_parallel_size=chunks)
    total, _, warmup, _ = get_pp_rank_microbatches(num_microbatches, chunks, group_size, forward_only=forward_only,
                                                   p2p_communicator=comm)
    chunk_of = [c for _, c in get_schedule_table(num_microbatches, chunks, group_size)]
    if forward_only:  # every virtual microbatch is a warm-up forward, nothing goes backward
        return [("F", c) for c in chunk_of]
    order = [("F", chunk_of[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", chunk_of[k + warmup]), ("B", chunks - 1 - chunk_of[k])]
    order += [("B", chunks - 1 - chunk_of[k]) for k in range(total - warmup, total)]
    return order


def pipeline_order(plan, stage: int, num_microbatches: int, group_size: int | None = None,
                   forward_only: bool = False) -> list[tuple[str, int]]:
    """The ("F" | "B", model chunk) steps an expert rank of pipeline stage `stage` mirrors in one
    step of `plan`: Megatron's schedule for its pipeline stages and virtual stages (chunk 0
    without virtual stages); forward_only: its forward-only pass (evaluation). `group_size`:
    config.microbatch_group_size_per_vp_stage (None: megatron-core's default, the stages)."""
    R, P, V = num_microbatches, plan.pipeline_stages, plan.virtual_stages
    if V > 1:
        return interleaved_order(R, P, stage, V, group_size or P, forward_only)
    if forward_only:
        return [("F", 0)] * R
    if P > 1:
        return [(step, 0) for step, _ in one_f_one_b(R, P, stage)]
    return [(step, 0) for _ in range(R) for step in ("F", "B")]


class _Stamp(torch.autograd.Function):
    """The identity, calling `on_backward()` when its gradient arrives (the time a backward
    reaches this point of the graph)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, on_backward: Callable[[], None]) -> torch.Tensor:
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.on_backward()
        return grad, None


class ExpertSpans:
    """The compute spans (E_F, E_B) of an expert rank's DistEP mirror, which runs no task list,
    for the expert-load log's seconds per task kind (training/expert_load_log.py): host timers on
    CPU ranks; on CUDA ranks timing events on the compute stream, resolved once at the step's end
    (CudaTiming: one host wait). The backward span runs from the experts' output gradient's arrival
    to their input gradient's (two identity autograd functions around the experts)."""

    def __init__(self, recorder, device: torch.device):
        self.recorder = recorder
        self.cuda = CudaTiming(device) if device.type == "cuda" else None
        self._backward_from: dict[tuple[int, int], object] = {}

    def _now(self):
        if self.cuda is None:
            return time.perf_counter()
        event = self.cuda.event()
        event.record(self.cuda.api.current_stream(self.cuda.device))
        return event

    def _add(self, kind: TaskKind, layer: int, microbatch: int, start, end) -> None:
        if self.cuda is None:
            self.recorder.record("compute", kind, layer, microbatch, start, end)
        else:
            self.cuda.add("compute", Task(kind, layer, microbatch), start, end)

    def run(self, layer: int, microbatch: int, recv: torch.Tensor,
            experts: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """experts(recv), timed forward and backward."""
        key = (layer, microbatch)
        recv = _Stamp.apply(recv, lambda: self._backward_done(key))
        start = self._now()
        out = experts(recv)
        self._add(TaskKind.E_F, layer, microbatch, start, self._now())
        return _Stamp.apply(out, lambda: self._backward_from.__setitem__(key, self._now()))

    def _backward_done(self, key: tuple[int, int]) -> None:
        start = self._backward_from.pop(key, None)
        if start is not None:  # None: the experts' output did not depend on their input (no expert here)
            self._add(TaskKind.E_B, *key, start, self._now())

    def resolve(self) -> None:
        """After the step's work is enqueued: CUDA spans into the recorder."""
        if self.cuda is not None:
            self.cuda.resolve(self.recorder)


def expert_distep(runtime, num_microbatches: int, forward_only: bool = False,
                  spans: ExpertSpans | None = None) -> None:
    """`runtime`: the rank's models.experts.ExpertRuntime. forward_only: the mirror of a
    forward-only pass (evaluation): every layer forward, no backward. `spans`: time the training
    step's expert compute."""
    hs = runtime.hs
    plan = hs.plan
    H = runtime.config.hidden_size
    layers = [plan.chunk_moe_layers(hs.stage, c) for c in range(plan.virtual_stages)]
    order = pipeline_order(plan, hs.stage, num_microbatches,
                           getattr(runtime.config, "microbatch_group_size_per_vp_stage", None), forward_only)
    if forward_only:
        with torch.no_grad():
            for _, c in order:
                for layer in layers[c]:
                    runtime.forward_layer(layer, H)
        return
    # each chunk's forwards' combine results, in forward order
    alive = [collections.deque() for _ in layers]
    forwards = [0] * len(layers)  # each chunk's microbatches gone forward so far
    for step, c in order:
        if step == "F":
            mb, forwards[c] = forwards[c], forwards[c] + 1
            alive[c].append([runtime.forward_layer(layer, H, spans, mb) for layer in layers[c]])
        else:
            for out in reversed(alive[c].popleft()):
                torch.autograd.backward(out, torch.zeros_like(out))
    if spans is not None:
        spans.resolve()
