"""DistEP on an expert rank: the mirror of Megatron's no-pipelining schedule that the attention
ranks run with HeteroMoELayer (for each microbatch, every layer forward, then every layer
backward in reverse), so both sides enter the same collectives in the same order."""
from __future__ import annotations

import contextlib

import torch


def expert_distep(runtime, num_microbatches: int, forward_only: bool = False) -> None:
    """`runtime`: the rank's models.experts.ExpertRuntime. forward_only: the mirror of a
    forward-only pass (evaluation): every layer forward, no backward."""
    L = runtime.hs.plan.num_layers
    H = runtime.config.hidden_size
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for _ in range(num_microbatches):
            sent = [runtime.forward_layer(layer, H) for layer in range(L)]
            if forward_only:
                continue
            for layer in reversed(range(L)):
                torch.autograd.backward(sent[layer], torch.zeros_like(sent[layer]))
