"""megatron-core's CUDA RNG tracker (megatron.core.tensor_parallel.random) on a CPU rank."""
from __future__ import annotations

import logging

import torch


def set_rng_state_on_cpu() -> None:
    """Give megatron's CUDA RNG tracker the CPU generator: its `_set_cuda_rng_state` sets the
    CPU state (torch_cuda.rng_on_cpu is the other half).

    Why: `CudaRNGStatesTracker.add/fork` restore states through it, which fails without CUDA.
    Forks (tensor-parallel and expert-parallel init regions) keep their own CPU generator states
    so a forked region does not disturb the default stream of random numbers, as on GPU.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    # On CPU the "CUDA" generator is the CPU one, so the tracker's check that a fork left the
    # CPU state alone always fires; it carries no information here.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda rec: "CPU RNG state changed" not in rec.getMessage()
    )
