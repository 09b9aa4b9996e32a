"""Count, on the CPU, the host synchronizations a GPU run of the same code would make.

torch.cuda.set_sync_debug_mode sees synchronizations on a GPU only. `HostSyncs` is a torch function
mode plus a torch dispatch mode that records, while active, every operation that on a GPU waits for
the device:
- a read of a device tensor's values into Python: .item(), .tolist(), bool() / int() / float() /
  index use, .cpu(), .numpy(), .to("cpu"), torch.equal / allclose;
- an operator whose output shape depends on values, so the device must report a count first:
  nonzero, masked_select, unique, indexing or index_put with a boolean mask, repeat_interleave
  without output_size, bincount (nonzero_static and the like take their size from the caller: free);
- a C++-side scalar read (_local_scalar_dense, is_nonzero) outside the Python reads above;
- a copy of Python values to the device: torch.tensor / as_tensor(data, device=...) (a blocking
  host-to-device copy, which torch's sync debug mode reports too).

Which tensors live on the device: all of them, unless they are host tensors: marked with `host(t)`,
made by a factory without a device (on a GPU run those are CPU tensors), the result of a read, or
computed from host tensors only. Reading a host tensor costs nothing.

Backward passes started inside the mode (Tensor.backward, torch.autograd.backward) run with the
mode active, so a custom autograd Function's Python backward is seen too.

A `param.data.to(...)` moves storage and is no read (Megatron's router moves its weights to the
current device so, which is the CPU in a CPU run).

What it cannot see: a `.to(device)` of a host tensor (on the CPU the target is the CPU as well;
non-blocking copies are free on a GPU, blocking ones are not) and synchronizations inside C++ that
go through no operator (a cudaStreamSynchronize in a kernel's host code, NCCL). Every counted event
keeps where it was issued (`Sync.site`), so a failing count says what to look at.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
          torch.Tensor.is_nonzero, torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose}
_DATA_COPY_FACTORIES = {torch.tensor, torch.as_tensor}
# Output shape decided by values: the device reports a size to the host first.
_DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                   aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount}
_MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_SCALAR_READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}


@dataclass(frozen=True)
class Sync:
    kind: str  # "read", "shape", "scalar", "h2d"
    op: str
    site: str  # the innermost frame outside torch and this file
    phase: str | None


def _site() -> str:
    for f in reversed(traceback.extract_stack()):
        # the CPU backend's cuda -> cpu torch function mode sits between the caller and torch
        if f.filename.endswith(("sync_count.py", "overrides.py", "_python_dispatch.py", "parallel/cpu_backend.py")) \
                or "/torch/" in f.filename:
            continue
        return f"{f.filename}:{f.lineno}"
    return "?"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _to_cpu(args, kwargs) -> bool:
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, torch.device) and a.type == "cpu" or isinstance(a, str) and a.split(":")[0] == "cpu":
            return True
    return False


def _run_backward(tensors, grad_tensors, retain_graph, create_graph, inputs) -> None:
    """torch.autograd.backward's engine call, without its torch-function dispatch (which would
    come back to the mode and hide the backward's Python code from it)."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    elif isinstance(grad_tensors, torch.Tensor):
        grad_tensors = [grad_tensors]
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grad_tensors))
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    keep = create_graph if retain_graph is None else retain_graph
    torch.autograd.Variable._execution_engine.run_backward(tensors, grads, keep, create_graph, inputs, True, True)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        o = self.owner
        inputs = _tensors((args, kwargs))
        on_device = any(o.on_device(t) for t in inputs)
        if not o.reading and on_device:
            packet = func.overloadpacket
            if packet in _DATA_DEPENDENT:
                o.record("shape", str(packet))
            elif packet in _MASK_INDEXED and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2])):
                o.record("shape", f"{packet} with a boolean mask")
            elif packet is aten.repeat_interleave and kwargs.get("output_size") is None:
                o.record("shape", f"{packet} without output_size")
            elif packet in _SCALAR_READS:
                o.record("scalar", str(packet))
        if inputs:
            o.mark(out, host=not on_device)
        return out


class HostSyncs(TorchFunctionMode):
    """The host synchronizations of the code run inside it (module docstring). `events` lists
    them; `count(phase)` counts those recorded inside `with syncs.phase(name)`."""

    def __init__(self):
        super().__init__()
        self.events: list[Sync] = []
        self.reading = 0
        self._phase: str | None = None
        self._host = WeakIdKeyDictionary()
        self._storage = WeakIdKeyDictionary()  # results of a `.data` getter
        self._dispatch = _Dispatch(self)
        self._depth = 0

    # ---- host or device ----------------------------------------------------------------------
    def host(self, *tensors: torch.Tensor) -> None:
        """Declare tensors host tensors (e.g. a route's split sizes, which a GPU run keeps on the CPU)."""
        for t in tensors:
            self._host[t] = True

    def on_device(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.Tensor) and t not in self._host

    def mark(self, out, host: bool) -> None:
        for t in _tensors(out):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

    # ---- counting ----------------------------------------------------------------------------
    def record(self, kind: str, op: str) -> None:
        self.events.append(Sync(kind, op, _site(), self._phase))

    def count(self, phase: str | None = None) -> int:
        return len(self.events) if phase is None else sum(e.phase == phase for e in self.events)

    def sites(self, phase: str | None = None) -> list[str]:
        return [f"{e.kind} {e.op} at {e.site}" for e in self.events if phase is None or e.phase == phase]

    @contextlib.contextmanager
    def phase(self, name: str):
        before, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = before

    # ---- the modes -----------------------------------------------------------------------------
    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            self._dispatch.__exit__(*exc)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARD:
            if func is torch.Tensor.backward:
                params = dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), args[1:]), **kwargs)
                call = (args[0], params.get("gradient"), params.get("retain_graph"), params.get("create_graph", False),
                        params.get("inputs"))
            else:
                params = dict(zip(("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables",
                                   "inputs"), args), **kwargs)
                call = (params["tensors"], params.get("grad_tensors"), params.get("retain_graph"),
                        params.get("create_graph", False), params.get("inputs"))
            with self:  # the backward's Python code (custom Functions) runs inside the mode
                _run_backward(*call)
            return None
        src = args[0] if args else None
        if getattr(func, "__self__", None) is torch.Tensor.data:  # the `.data` getter
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self._storage[out] = True
            return out
        if func is torch.Tensor.to and isinstance(src, torch.Tensor) and src in self._storage:
            # Megatron's router moves its weights' storage to the current device when they are on
            # the CPU (a CPU run's device): moving storage, not reading values.
            return func(*args, **kwargs)
        if func in _READS or func is torch.Tensor.to and _to_cpu(args, kwargs):
            device = any(self.on_device(t) for t in _tensors(args))
            self.reading += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self.reading -= 1
            if device:
                self.record("read", getattr(func, "__name__", str(func)))
            if isinstance(out, torch.Tensor):
                if out is src:  # .cpu() of a CPU tensor is itself: a new view stands for the host copy
                    if not device:
                        return out
                    out = out.view_as(out)
                self.mark(out, host=True)
            return out
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        if inputs:
            self.mark(out, host=not any(self.on_device(t) for t in inputs))
        elif isinstance(out, torch.Tensor):  # a factory: a CPU tensor unless given a device
            on_device = kwargs.get("device") is not None
            if on_device and func in _DATA_COPY_FACTORIES:
                self.record("h2d", getattr(func, "__name__", str(func)))
            self.mark(out, host=not on_device)
        return out
