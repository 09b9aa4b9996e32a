"""torch.distributed's collectives (and megatron-core's module-level aliases of them), wrapped to
trace the order every rank enters them (reliability/collective_trace.py records and checks)."""
from __future__ import annotations

import sys
from pathlib import Path


def trace_collectives(rank: int | None = None) -> Path | None:
    """Trace this process's collectives into $HETERMOE_TRACE_COLLECTIVES (no-op without it, and
    when already tracing). Returns the rank's trace file.

    Why a patch: the trace must see every collective, Megatron's included, without a change to
    the code that calls them. torch.distributed's functions are replaced in torch.distributed and,
    where it is the same function, in distributed_c10d (where torch looks itself up: P2POp
    accepts only c10d's own isend/irecv); megatron-core's param_and_grad_buffer binds its
    bucket reduce-scatter and all-gather at import (collective_trace.ALIASES)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from megatron_hetermoe.reliability import collective_trace

    path, new = collective_trace.trace_file(rank)
    if not new:
        return path
    wrapped = {}
    for name in (*collective_trace.COLLECTIVES, *collective_trace.POINT_TO_POINT):
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_hetermoe_traced", False):
            wrapped[fn] = collective_trace.traced(fn, name, path)
            setattr(dist, name, wrapped[fn])
            if getattr(distributed_c10d, name, None) is fn:
                setattr(distributed_c10d, name, wrapped[fn])
    for module, names in collective_trace.ALIASES.items():
        mod = sys.modules.get(module)
        for name in names if mod is not None else ():
            fn = getattr(mod, name, None)
            if fn in wrapped:
                setattr(mod, name, wrapped[fn])
    collective_trace.started(path)
    return path
