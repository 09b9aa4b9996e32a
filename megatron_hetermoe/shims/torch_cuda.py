"""torch.cuda on a CPU rank (parallel/cpu_backend.py installs these where no CUDA is used).

megatron-core calls torch.cuda for streams, events, the current device and its RNG; on a CPU rank
over gloo each call stands in for the CPU's answer. Needed by every megatron-core release
0.16.1 .. 0.19 (the canaries of tests/parallel/test_cpu_backend.py show each failure without it).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class CpuStream:
    """Stands in for torch.cuda.Stream: CPU ops are synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "CpuEvent":
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuEvent:
    """Stands in for torch.cuda.Event; elapsed_time is not meaningful on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = CpuStream()


def stand_in_streams() -> None:
    """Fake torch.cuda.Stream/current_stream/stream/Event/synchronize (and Tensor.record_stream).

    Why: the alltoall dispatcher copies split sizes on a side stream
    (`torch.cuda.Stream()`), DDP creates a communication stream, and both record events.
    """
    torch.cuda.Stream = CpuStream
    torch.cuda.Event = CpuEvent
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    torch.cuda.default_stream = lambda device=None: _CPU_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.record_stream = lambda self, stream: None


def current_device_is_cpu() -> None:
    """Make torch.cuda.current_device() name the CPU.

    Why: megatron allocates its global memory buffer, router buffers, all_to_all outputs and
    p2p shape tensors with `device=torch.cuda.current_device()`.
    """
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0


def rng_on_cpu() -> None:
    """torch.cuda's RNG state and seeding on the CPU generator.

    Why: `model_parallel_cuda_manual_seed` and `CudaRNGStatesTracker.add/fork` call
    torch.cuda.manual_seed / get_rng_state / set_rng_state, which fail without CUDA
    (tensor_parallel_random.set_rng_state_on_cpu is the other half)."""
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the generator directly.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.initial_seed = lambda: torch.initial_seed()


def answer_no_cuda() -> None:
    """torch.cuda.is_available() answers False from now on: this process is a CPU rank on a GPU
    host, and a GPU host's answer (cached by torch from before a fork) must not steer code onto CUDA."""
    torch.cuda.is_available = lambda: False


@contextlib.contextmanager
def one_device() -> Iterator[None]:
    """torch.cuda.device_count() answers 1 for the block. Why: Megatron-LM's
    _initialize_distributed calls initialize_model_parallel only when it is > 0; the CPU
    backend's device is the CPU (set_device is a no-op)."""
    count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = count
