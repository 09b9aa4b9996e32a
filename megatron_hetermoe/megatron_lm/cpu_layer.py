"""Megatron-LM's pretrain() on CPU ranks over gloo, HeterMoE or not: the CPU backend
(parallel/cpu_backend.py) and what Megatron-LM needs besides it (shims/megatron_training.py
cpu_rank, shims/pipeline_schedules.py, shims/distrib_optimizer.py), in place for one call."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from megatron_hetermoe.shims import distrib_optimizer, megatron_training, pipeline_schedules


@contextlib.contextmanager
def cpu_layer() -> Iterator[None]:
    """Megatron-LM's pretrain() on CPU ranks over gloo, HeterMoE or not, for the block: the CPU
    backend stands in for CUDA, and the shims let Megatron's own code do the rest."""
    from megatron_hetermoe.parallel import cpu_backend
    from megatron_hetermoe.shims.moe_utils import bind_missing_te_general_gemm

    cpu_backend.apply()
    bind_missing_te_general_gemm()  # megatron's router needs it without transformer-engine (shims/moe_utils.py)
    with megatron_training.cpu_rank(), pipeline_schedules.outputs_kept(), distrib_optimizer.torch_adam_state_dict():
        yield


def megatron_on_cpu(pretrain: Callable) -> Callable:
    """Megatron-LM's pretrain() with the CPU layer (cpu_layer) in place on a host without CUDA;
    unchanged where CUDA exists. Lets a plain Megatron EP run share the CPU tests' machine (its
    checkpoints load into HeterMoE runs and back)."""
    if torch.cuda.is_available():
        return pretrain
    # core_v0.19.0's pretrain_gpt.py validates its flags before pretrain(), in this CPU-only process.
    megatron_training.no_cuda_arch_for_good()

    def on_cpu(*a, **k):
        with cpu_layer():
            return pretrain(*a, **k)

    return on_cpu
