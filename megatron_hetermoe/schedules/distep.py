"""DistEP on an expert rank: the mirror of the Megatron schedule that the attention ranks of its
pipeline stage run with HeteroMoELayer, so both sides enter the same collectives in the same
order. Without pipeline stages that is Megatron's no-pipelining schedule (for each microbatch,
every layer forward, then every layer backward in reverse); with them, Megatron's 1F1B
(forward_backward_pipelining_without_interleaving) at this rank's stage: its warm-up forwards,
then one forward and one backward at a time, then the cool-down backwards, each over the stage's
layers only."""
from __future__ import annotations

import collections

import torch


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


def expert_distep(runtime, num_microbatches: int, forward_only: bool = False) -> None:
    """`runtime`: the rank's models.experts.ExpertRuntime. forward_only: the mirror of a
    forward-only pass (evaluation): every layer forward, no backward."""
    hs = runtime.hs
    plan = hs.plan
    layers = plan.stage_moe_layers(hs.stage)
    H = runtime.config.hidden_size
    if forward_only:
        with torch.no_grad():
            for _ in range(num_microbatches):
                for layer in layers:
                    runtime.forward_layer(layer, H)
        return
    order = (one_f_one_b(num_microbatches, plan.pipeline_stages, hs.stage) if plan.pipeline_stages > 1
             else [(step, i) for i in range(num_microbatches) for step in ("F", "B")])
    alive: collections.deque = collections.deque()  # each forward's combine results, in forward order
    for step, _ in order:
        if step == "F":
            alive.append([runtime.forward_layer(layer, H) for layer in layers])
        else:
            for out in reversed(alive.popleft()):
                torch.autograd.backward(out, torch.zeros_like(out))
