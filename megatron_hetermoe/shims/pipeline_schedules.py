"""megatron-core's pipeline schedules (megatron.core.pipeline_parallel.schedules) on CPU ranks."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_hetermoe.shims._replace import replaced


@contextlib.contextmanager
def outputs_kept() -> Iterator[None]:
    """For the block, a stage's output is never freed after its send.

    Why: the interleaved schedule (--overlap-p2p-comm) frees a stage's output
    (deallocate_output_tensor) right after starting its asynchronous send: safe with NCCL,
    which sends on a stream the caching allocator waits for, but gloo's isend still reads
    the freed buffer from its own thread, and the next stage receives garbage now and then
    (measured: 3 of 3 HeterMoE runs off by up to 0.14 in the loss). CPU ranks keep outputs,
    and backward goes through torch.autograd.backward, which custom_backward stands in for
    only so that a freed output's shape goes unchecked."""
    import megatron.core.pipeline_parallel.schedules as schedules

    with replaced([
        (schedules, "deallocate_output_tensor", lambda out, deallocate_pipeline_outputs=False: None),
        (schedules, "custom_backward", lambda output, grad_output: torch.autograd.backward(output, grad_output)),
    ]):
        yield
