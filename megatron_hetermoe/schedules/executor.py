"""Executes one rank's task list (schedules/tasks.py) for one step.

Compute tasks run on the issuing thread in list order. Each transfer is submitted, in list
order, to the stream its task names ("dispatch" or "combine"); a stream runs its transfers in
FIFO order, as a CUDA stream would. A compute task waits only for the transfer that
schedules.tasks.inputs() names as its input; everything else overlaps.

A `Stream` is the abstraction: `ThreadStream` (a worker thread per stream, the CPU/gloo
runtime) implements it today; a CUDA-stream implementation plugs in through `make_stream`.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Callable, Protocol

import torch

from megatron_hetermoe.config import ZebraConfig
from megatron_hetermoe.emulation.clock import sleep_until
from megatron_hetermoe.reliability import faults
from megatron_hetermoe.schedules.tasks import Task, inputs
from megatron_hetermoe.tools.timeline import TimelineRecorder

OnDone = Callable[[str, Task, float], None]


class Stream(Protocol):
    name: str
    ready: dict  # Task -> when it could start (issued, and the stream free)
    executed: list  # transfers in the order they ran

    def submit(self, task: Task, fn: Callable[[], object], issued: float = 0.0) -> Future: ...

    def close(self) -> None:
        """Wait for every submitted transfer, then stop."""

    def abandon(self) -> None:
        """Stop without waiting (a transfer may be blocked on a dead peer)."""


class ThreadStream:
    """A worker thread running one stream's transfers in FIFO order."""

    def __init__(self, name: str, recorder: TimelineRecorder | None, failure: Future, on_done: OnDone | None = None):
        self.name, self.recorder = name, recorder
        self.failure = failure  # shared by a rank's streams: set by the first failed transfer
        self.on_done = on_done  # (stream, task, end) before the task's future resolves
        self.ready: dict[Task, float] = {}
        self.last_end = 0.0  # when this stream's previous transfer ended
        self.q: queue.Queue = queue.Queue()
        self.executed: list[Task] = []
        self.failed: BaseException | None = None
        self.t = threading.Thread(target=self._loop, name=f"zebra-{name}", daemon=True)
        self.t.start()

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            task, fn, fut, issued = item
            if self.failed is not None:
                # After a failed collective every later one would pair with the wrong collective
                # of the peers (gloo then aborts them on a size mismatch): issue nothing more.
                fut.set_exception(self.failed)
                continue
            self.ready[task] = max(issued, self.last_end)
            t0 = time.perf_counter()
            try:
                result = fn()
                t1 = self.last_end = time.perf_counter()
                if self.on_done is not None:
                    self.on_done(self.name, task, t1)
                fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 - surfaced to the issuing thread by wait()
                self.failed = e
                fut.set_exception(e)
                if not self.failure.done():
                    self.failure.set_exception(e)
                continue
            self.executed.append(task)
            if self.recorder is not None:
                self.recorder.record(self.name, task.kind, task.layer, task.microbatch, t0, t1)

    def submit(self, task: Task, fn, issued: float = 0.0) -> Future:
        """Queue a transfer; `issued`: when the rank reached it in its list (the end of the
        compute task before it)."""
        fut: Future = Future()
        self.q.put((task, fn, fut, issued))
        return fut

    def close(self):
        self.q.put(None)
        self.t.join()

    def abandon(self):
        # A daemon thread blocked in a collective with a dead peer: do not join it (its
        # collective times out); the error ends the rank now.
        self.q.put(None)


StreamFactory = Callable[[str, "TimelineRecorder | None", Future, OnDone], Stream]


class TaskExecutor:
    """Runs one task list: compute on this thread, transfers on the streams."""

    STREAMS = ("dispatch", "combine")

    def __init__(self, num_layers: int, cfg: ZebraConfig, recorder: TimelineRecorder | None,
                 make_stream: StreamFactory = ThreadStream):
        self.L, self.cfg, self.recorder, self.make_stream = num_layers, cfg, recorder, make_stream
        self.executed: list[Task] = []
        self.executed_streams: dict[str, list[Task]] = {}
        self.meter = ActivationMeter()
        self.windows: dict[Task, tuple] = {}  # emulated transfer: (start, budget, real_end)
        self.ready: Callable[[Task], float] = lambda task: time.perf_counter()  # when a transfer could start

    def run(self, tasks: list[Task], compute: Callable[[Task], None],
            transfer: Callable[[Task], Callable[[], None]]) -> None:
        """`transfer(task)` returns the function a stream runs for a transfer task."""
        failure: Future = Future()
        clock = self.cfg.clock
        tx_end: dict[Task, float] = {}  # when each transfer ended

        def done(stream: str, task: Task, end: float) -> None:
            tx_end[task] = end
            info = self.windows.pop(task, None)
            if clock is not None and info is not None:
                start, budget, real_end = info
                clock.window(stream, task, start, budget, real_end, end)

        streams = {name: self.make_stream(name, self.recorder, failure, done) for name in self.STREAMS}
        self.ready = lambda task: streams[task.stream].ready.pop(task, time.perf_counter())
        futures: dict[Task, Future] = {}

        def wait(fut: Future) -> None:
            # A failed transfer on one stream can leave the other stream (and so `fut`) blocked
            # on peers that wait for the failed one: wake up on either.
            futures_wait([fut, failure], return_when=FIRST_COMPLETED)
            if failure.done():
                failure.result()
            fut.result()

        last_end = clock.t0 if clock is not None else time.perf_counter()  # the previous compute task's end
        try:
            self.meter.__enter__()
            for t in tasks:
                if t.is_comm:
                    futures[t] = streams[t.stream].submit(t, transfer(t), last_end)
                    continue
                need = inputs(t, self.L)
                if need is not None:
                    wait(futures[need])
                # When emulating, a task's time starts when it could (the previous task ended and
                # its input arrived), as in the simulator: the host's delay in getting to it and
                # the real work both run inside its emulated time.
                ready = max(last_end, tx_end.get(need, last_end))
                t0 = time.perf_counter()
                faults.checkpoint("task", repr(t))
                compute(t)
                if self.cfg.stretch is not None:
                    real_end = time.perf_counter()
                    budget = self.cfg.stretch(t)
                    t0 = min(t0, ready)
                    sleep_until(t0 + budget)
                last_end = time.perf_counter()
                if clock is not None and self.cfg.stretch is not None:
                    clock.window("compute", t, t0, budget, real_end, last_end)
                self.executed.append(t)
                if self.recorder is not None:
                    self.recorder.record("compute", t.kind, t.layer, t.microbatch, t0, last_end)
            for f in futures.values():
                wait(f)
        except BaseException:
            for s in streams.values():
                s.abandon()
            raise
        else:
            for s in streams.values():
                s.close()
        finally:
            self.meter.__exit__(None, None, None)
        self.executed_streams = {k: s.executed for k, s in streams.items()}


class ActivationMeter:
    """Peak bytes of tensors saved for backward (activations; parameters excluded), tracked
    with autograd's saved-tensor hooks: a tensor counts from when it is saved until autograd
    drops it."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or id(t) in self._ids:
            return t
        n = t.numel() * t.element_size()
        self._ids.add(id(t))
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, id(t), n)
        return t

    def _free(self, key: int, n: int) -> None:
        self._ids.discard(key)
        self.live -= n

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
