"""Forced routing for parity tests (tests/integration/test_routing_extremes.py explains the
construction): a plain Megatron initial state, and weights that make every token prefer the
given experts, identically for Megatron and HeterMoE."""
from __future__ import annotations

import torch

from megatron_hetermoe.config import ModelConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.training.args import run
from megatron_hetermoe.training.run_hooks import RunHooks


def initial_state(model: ModelConfig, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The seed's plain Megatron initial state (canonical names), from a 0-step 1-rank run."""
    cfg = TrainConfig(model, ParallelConfig(), micro_batch_size=1, global_batch_size=1, train_iters=0,
                      seed=seed, quiet=True)
    return run(cfg, 1, hooks=RunHooks(collect_grads=True)).initial_params


def force_routing(state: dict[str, torch.Tensor], experts: list[int], num_layers: int) -> dict[str, torch.Tensor]:
    """Make every token of every layer prefer `experts` in this order (see the module doc)."""
    state = {k: v.clone() for k, v in state.items()}
    state["embedding.word_embeddings.weight"][:, 0] = 1.0
    for layer in range(num_layers):
        w = state[f"decoder.layers.{layer}.mlp.router.weight"]
        w[:, 0] = 0.0
        for i, e in enumerate(experts):
            w[e, 0] = 5.0 - 0.1 * i
    return state
