"""Instances of megatron-core's DistributedDataParallel (a model chunk): its param sync and the
finish of its grad sync, on one object."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def param_sync_deferred(chunks: list, optimizers: list) -> Iterator[None]:
    """For the block, each chunk's `start_param_sync()` does nothing (megatron-core 0.16's
    distributed optimizer calls it after its step) and each of `optimizers` has megatron-core
    0.19's `_defer_param_sync` set (0.19's syncs its own bucket groups unless it is; 0.16 never
    reads it); after it, the class's method and no deferral again. Why: the distributed optimizer
    all-gathers the parameters after each of its sub-optimizers steps, and ranks of one
    data-parallel group may hold different numbers of them (training/assembly.py _one_param_sync
    runs the sync once, after all stepped)."""
    for c in chunks:
        c.start_param_sync = lambda *a, **k: None
    for o in optimizers:
        o._defer_param_sync = True
    try:
        yield
    finally:
        for c in chunks:
            del c.start_param_sync  # the class's method again
        for o in optimizers:
            o._defer_param_sync = False


def before_finish_grad_sync(chunk, before: Callable[[], None]) -> None:
    """`chunk.finish_grad_sync()` calls `before()` first. Why: the NaN guard scans the gradients
    as they are complete, before the data-parallel reduction mixes one rank's NaN into every
    rank's (training/nan_check.py)."""
    finish = chunk.finish_grad_sync

    def finish_grad_sync(*args, **kwargs):
        before()
        return finish(*args, **kwargs)

    chunk.finish_grad_sync = finish_grad_sync
