"""Executes one rank's task list (plan/tasks.py) for one step.

Compute tasks run on the issuing thread in list order. Each transfer is submitted, in list
order, to the stream its task names ("dispatch" or "combine"); a stream runs its transfers in
FIFO order. A compute task waits only for the transfer that plan.tasks.inputs() names as
its input (`wait`, then `Stream.consume`); everything else overlaps.

A `Stream` is the abstraction; `TaskExecutor` picks the implementation from the rank's device:

* `ThreadStream` (CPU ranks, gloo): a worker thread per stream runs the transfer function; its
  Future resolving means the data has arrived. The CPU runtime is exactly this.
* `CudaStream` (CUDA ranks over gloo): the same worker thread per stream, but each stream also owns a
  side CUDA stream (`torch.cuda.Stream(device)`, one per (device, stream name), made once per
  process) and the work is ordered on the device by events, not by host waits:
    - `submit` (compute thread) records a producer event on the compute thread's current
      stream: every compute task before the transfer in the list, i.e. the one that made its
      send buffer, has been enqueued by then;
    - the worker thread calls `set_device(device)` once, then per transfer runs
      `with torch.cuda.stream(side): side.wait_event(producer); fn(); done.record(side)`, so the
      collective (issued on the side stream) starts on the device only after its producer;
    - the consumer: TaskExecutor.run waits (host) for the worker to have *issued* the transfer
      (its Future), then `consume` makes the compute stream wait on the done event
      (`current_stream(device).wait_event(done)`) right before the dependent compute task is
      enqueued. No host synchronize anywhere in this path;
    - `close` (end of the step, compute thread) makes the compute stream wait on every done
      event not consumed yet, so what runs after the step (finalize grads, optimizer, the next
      step) is ordered after all of the step's transfers.
  The torch.cuda calls go through `CudaApi`, so tests drive the ordering with fake streams
  and events on CPU (tests/schedules/test_stream_ordering.py).

What the CUDA path achieves, and what it does not:
* Compute kernels (compute thread, its current stream) and the two streams' collectives are
  enqueued on different CUDA streams and may run concurrently; each side stream serializes its
  own transfers (FIFO, as ThreadStream). With NCCL, ProcessGroupNCCL runs each collective on
  its communicator's internal stream, fenced against the side stream (the current stream of
  the issuing worker thread) before and after, so the two groups' NCCL kernels run on two
  streams of two communicators, concurrently with compute.
* It is not host-free: `Transport.route` (D_F) reads the counts with `.tolist()`/`.item()`,
  which blocks that stream's worker thread until the side stream reached it, i.e. until the
  producer compute finished on the device. Only that worker blocks; the compute thread keeps
  enqueueing. schedules/issuer.py is the other executor: one issuing thread and no blocking
  call at all, the counts going ahead asynchronously on a third communicator and polled
  (the default on CUDA ranks; this one stays the default on CPU ranks and when emulating).
* A consumer's host wait is for the worker to have issued the transfer (the Python result
  objects, e.g. the received tensor, exist only then), not for the transfer to finish.
* Host times (time.perf_counter) are when work was enqueued: on CUDA a transfer's host end is
  when it was issued, not when it finished on the device. Emulated task times (a
  schedules/timing.TaskTiming) use host times on purpose (emulated clusters run on CPU ranks).
* Device times (`CudaTiming`): with a recorder and no emulation, a CUDA rank also records every
  compute task and transfer as a pair of timing events on the stream the work runs on (a
  compute task: the compute thread's current stream, after its input's done-event wait; a
  transfer: its side stream, after the producer wait, ending with its done event). At the end
  of a successful step, after the streams closed, one event more is recorded on the compute
  stream (which close() ordered after every transfer) and the host waits for it: the step's
  one synchronize, none inside the step. Each span is placed on the host axis backwards from
  the moment that wait returned (recorder clock "cuda"; schedules/timeline.py).
* Ordering: on each stream every member of the ZP group issues the same collectives in the same
  order (tasks.check_stream_order), each stream on its own process group, so each communicator
  sees one consistent order; across the two communicators there is none, which is safe only
  while every stream has a hardware queue of its own. This executor therefore runs CUDA tensors
  over gloo only (and CPU ranks); NCCL ranks use schedules/issuer.py, whose one issue order per
  rank (plan/issue_order.py) holds even with CUDA_DEVICE_MAX_CONNECTIONS=1, and NCCL does not
  allow several threads to issue to communicators of one device at once (issuer.resolve_issuer).

Tensors crossing streams (the caching allocator gives a freed block back to the stream that
allocated it, which may hand it out again at once). zebra.py drops each transferred buffer after
its last consumer and, on a CUDA rank, first calls `record_stream` for the stream that still
uses it (zebra._release):
* a received tensor (allocated inside `fn` on the side stream) after the compute task that reads
  it was enqueued: `record_stream(compute stream)`;
* a sent gradient (allocated on the compute stream: C_B's, D_B's) right after its transfer was
  issued: `record_stream(side stream)`;
* `permuted` (D_F's send) and `expert_out` (C_F's) are autograd outputs, freed by A_B(l, j) and
  E_B/X_B(l, j), which wait D_B(l, j) and C_B(l, j): the peers computed those from the very rows
  this rank sent, so the send had completed on the device.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Protocol

import torch

from megatron_hetermoe.parallel.device import bind_device
from megatron_hetermoe.parallel.extension import TaskTiming
from megatron_hetermoe.plan.tasks import Layers, Task, inputs
from megatron_hetermoe.reliability import faults
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.vocabulary import StreamName

OnDone = Callable[[str, Task, float], None]


class Stream(Protocol):
    name: str
    ready: dict  # Task -> when it could start (issued, and the stream free)
    executed: list  # transfers in the order they ran

    def submit(self, task: Task, fn: Callable[[], object], issued: float = 0.0) -> Future: ...

    def consume(self, task: Task) -> None:
        """On the compute thread, after `task`'s Future resolved and right before the compute
        task that reads its result: order that compute after the transfer."""

    def close(self) -> None:
        """Wait for every submitted transfer, then stop."""

    def abandon(self) -> None:
        """Stop without waiting (a transfer may be blocked on a dead peer)."""

    def flush(self) -> None:
        """Wait for every submitted transfer and keep the stream for the next step (`begin`)."""

    def begin(self, failure: Future, on_done: OnDone | None) -> None:
        """Start another step on a flushed stream: its failure future and callback, nothing executed."""


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
        self.t = threading.Thread(target=bind_device(self._loop), name=f"zebra-{name}", daemon=True)
        self.t.start()

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            if isinstance(item, Future):  # flush(): every transfer queued before it has run
                item.set_result(None)
                continue
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

    def consume(self, task: Task) -> None:
        """The Future resolving means the data arrived: nothing to order."""

    def close(self):
        self.q.put(None)
        self.t.join()

    def flush(self) -> None:
        marker: Future = Future()
        self.q.put(marker)
        marker.result()  # the worker ran (and recorded) every transfer before it

    def begin(self, failure: Future, on_done: OnDone | None) -> None:
        if self.failed is not None:
            raise RuntimeError(f"stream {self.name!r} failed in an earlier step ({self.failed!r}); make a new one")
        self.failure, self.on_done = failure, on_done
        self.ready, self.executed = {}, []  # new lists: the previous step's stay with whoever read them

    def abandon(self):
        # A daemon thread blocked in a collective with a dead peer: do not join it (its
        # collective times out); the error ends the rank now.
        self.q.put(None)


class CudaApi:
    """The torch.cuda calls a CudaStream (and the single issuer's CudaTransport) makes, in one
    place so that tests can pass fake streams and events (`stream_type(device=...)`,
    `event_type()`; a stream has wait_event(event), an event record(stream) and query()). Side
    streams are made once per (device, name) and kept: a process may make several executors (a
    run makes one, kept over its steps; tests make many), and a fresh pool stream each time could
    be shared with other users of torch's stream pool."""

    def __init__(self, stream_type: Callable[..., Any] | None = None, event_type: Callable[[], Any] | None = None,
                 current_stream: Callable[[torch.device], Any] | None = None,
                 use_stream: Callable[[Any], Any] | None = None,
                 set_device: Callable[[torch.device], None] | None = None,
                 timing_event_type: Callable[[], Any] | None = None,
                 host_copy: Callable[[torch.Tensor], torch.Tensor] | None = None):
        # torch.cuda is looked up at each call, not here (at import).
        self.stream_type = stream_type or (lambda **kw: torch.cuda.Stream(**kw))
        self.event_type = event_type or (lambda: torch.cuda.Event())
        # CudaTiming's events: also record(stream), plus elapsed_time(later) in ms and synchronize().
        self.timing_event_type = timing_event_type or (lambda: torch.cuda.Event(enable_timing=True))
        self.current_stream = current_stream or (lambda d: torch.cuda.current_stream(d))  # this thread's
        self.use_stream = use_stream or (lambda s: torch.cuda.stream(s))  # context: make `s` current in this thread
        self.set_device = set_device or (lambda d: torch.cuda.set_device(d))
        # A device tensor's copy to pinned host memory, enqueued on the current stream (the single
        # issuer's counts: the host reads it once an event recorded after it completed).
        self.host_copy = host_copy or (lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                                       .copy_(t, non_blocking=True))
        self._side: dict[tuple[torch.device, str], Any] = {}
        self._lock = threading.Lock()

    def side_stream(self, device: torch.device, name: str):
        with self._lock:
            key = (device, name)
            if key not in self._side:
                self._side[key] = self.stream_type(device=device)
            return self._side[key]


CUDA = CudaApi()


class CudaTiming:
    """The device-side spans of one step of a CUDA rank: (lane, task, start event, end event),
    each pair recorded on the stream the task's work runs on; `resolve` turns them into
    recorder events (clock "cuda") once the step's work is enqueued. Thread-safe (the stream
    workers add their transfers)."""

    def __init__(self, device: torch.device, api: CudaApi | None = None):
        self.device, self.api = device, api or CUDA
        self.spans: list[tuple[str, Task, Any, Any]] = []
        self._lock = threading.Lock()
        self.host_clock: Callable[[], float] = time.perf_counter  # the recorder's axis (tests pin it)

    def event(self):
        return self.api.timing_event_type()

    def add(self, lane: str, task: Task, start, end) -> None:
        with self._lock:
            self.spans.append((lane, task, start, end))

    def resolve(self, recorder: TimelineRecorder) -> None:
        """Record every span in `recorder` on the host clock's axis. Call it on the compute
        thread after every span's end event was recorded and the compute stream was ordered
        after them (TaskExecutor.run: after the streams closed). One host wait: for an event
        recorded now on the compute stream; its completion is taken to be when that wait
        returned, and each span sits elapsed_time(span event, that event) before it. (Anchored at
        the step's end rather than its start: a start anchor's host time is when it was
        enqueued, which runs ahead of the device by whatever the compute stream still had
        queued; after the wait, host and device agree up to the wait's wake-up latency.)"""
        anchor = self.event()
        anchor.record(self.api.current_stream(self.device))
        anchor.synchronize()
        now = self.host_clock()
        with self._lock:
            spans, self.spans = self.spans, []
        for lane, t, a, b in spans:
            start = now - a.elapsed_time(anchor) / 1e3
            end = now - b.elapsed_time(anchor) / 1e3
            recorder.record(lane, t.kind, t.layer, t.microbatch, start, end, clock="cuda")


class StageIO(Protocol):
    """An attention rank's traffic with the neighbouring pipeline stages (plan.tasks.PipeTask),
    done by the executor around the compute task that consumes or produces it (zebra.py
    _PipelineNeighbours), so that a compute task's time starts after its stage input arrived."""

    def receive(self, task: Task, ready: float) -> float | None:
        """Before `task` (`ready`: when the rank reached it): receive the stage input it needs, if
        any; returns when it arrived (emulated: the end of its transfer's window), else None."""

    def send(self, task: Task, end: float) -> None:
        """After `task` (ended at `end`): send what it produced for a neighbouring stage, if any."""


def run_compute(task: Task, compute: Callable[[Task], None], timing: CudaTiming | None) -> None:
    """Run (CPU) or enqueue (CUDA) one compute task; with `timing`, between two timing events on
    the compute stream, the first after its input's done-event wait."""
    faults.checkpoint("task", repr(task))
    if timing is None:
        compute(task)
        return
    ev0 = timing.event()
    ev0.record(timing.api.current_stream(timing.device))
    compute(task)
    ev1 = timing.event()
    ev1.record(timing.api.current_stream(timing.device))
    timing.add("compute", task, ev0, ev1)


class CudaStream(ThreadStream):
    """ThreadStream's worker thread issuing on its own CUDA stream, ordered against the compute
    stream by events (see the module docstring for what is and is not overlapped). With a
    `timing`, each transfer also records a start event on the side stream after its producer
    wait, and its done event is a timing event that ends the span."""

    def __init__(self, name: str, recorder: TimelineRecorder | None, failure: Future, on_done: OnDone | None = None,
                 *, device: torch.device, api: CudaApi | None = None, timing: CudaTiming | None = None):
        self.device, self.api, self.timing = device, api or CUDA, timing
        self.side = self.api.side_stream(device, name)
        self.done: dict[Task, Any] = {}  # transfer -> its done event, until consumed or closed
        super().__init__(name, recorder, failure, on_done)  # starts the worker

    def _loop(self):
        self.api.set_device(self.device)  # this thread's current device: the side stream's
        super()._loop()

    def submit(self, task: Task, fn, issued: float = 0.0) -> Future:
        producer = self.api.event_type()
        producer.record(self.api.current_stream(self.device))  # after the compute enqueued so far
        timing = self.timing
        done = self.api.event_type() if timing is None else timing.event()
        self.done[task] = done
        side, use_stream, name = self.side, self.api.use_stream, self.name

        def on_side_stream():
            with use_stream(side):
                side.wait_event(producer)
                if timing is not None:
                    start = timing.event()
                    start.record(side)  # the transfer can start on the device: producer done, stream free
                out = fn()
                done.record(side)  # before the Future resolves: consume() never waits an unrecorded event
                if timing is not None:
                    timing.add(name, task, start, done)
            return out

        return super().submit(task, on_side_stream, issued)

    def consume(self, task: Task) -> None:
        self.api.current_stream(self.device).wait_event(self.done.pop(task))

    def close(self):
        super().close()  # every transfer issued (and its done event recorded)
        self._join_compute()

    def flush(self) -> None:
        super().flush()
        self._join_compute()

    def _join_compute(self) -> None:
        compute = self.api.current_stream(self.device)
        for done in self.done.values():
            compute.wait_event(done)
        self.done.clear()


def stream_factory(device: torch.device, api: CudaApi | None = None,
                   timing: CudaTiming | None = None) -> "StreamFactory":
    """The Stream implementation for a rank's device: CudaStream on CUDA (timing its transfers
    into `timing` when given), else ThreadStream."""
    if torch.device(device).type == "cuda":
        kw = {} if timing is None else {"timing": timing}
        return functools.partial(CudaStream, device=torch.device(device), api=api, **kw)
    return ThreadStream


StreamFactory = Callable[[str, "TimelineRecorder | None", Future, OnDone], Stream]


class TaskExecutor:
    """Runs one task list: compute on this thread, transfers on the streams."""

    STREAMS = (StreamName.DISPATCH, StreamName.COMBINE)

    def __init__(self, num_layers: Layers, recorder: TimelineRecorder | None, task_timing: TaskTiming | None = None,
                 make_stream: StreamFactory | None = None, device: torch.device = torch.device("cpu"),
                 api: CudaApi | None = None, keep_streams: bool = False):
        """`device`: the rank's device; picks the Stream (stream_factory) unless `make_stream`
        is given. `task_timing`: emulated task times (schedules/timing.py), else real ones. On a
        CUDA device with a recorder and no emulation, every task is also timed on the device
        (`CudaTiming`, through `api`: torch.cuda by default); the transfers are timed by the
        streams stream_factory makes, not by a given `make_stream`. `keep_streams`: a successful
        run leaves its streams' (daemon) worker threads waiting for the next run, which reuses
        them, instead of joining them; `close()` ends them (a failed run always drops them)."""
        self.L, self.recorder, self.device = num_layers, recorder, torch.device(device)
        self.task_timing = task_timing
        self.timing = (CudaTiming(self.device, api)
                       if self.device.type == "cuda" and recorder is not None and task_timing is None else None)
        self.make_stream = make_stream if make_stream is not None else stream_factory(self.device, api, self.timing)
        self.executed: list[Task] = []
        self.executed_streams: dict[str, list[Task]] = {}
        self.meter = ActivationMeter()
        self.ready: Callable[[Task], float] = lambda task: time.perf_counter()  # when a transfer could start
        self.keep_streams = keep_streams
        self._streams: dict[str, Stream] | None = None  # kept from the previous run (keep_streams)

    def close(self) -> None:
        """End the streams a run kept (keep_streams); the next run makes new ones."""
        streams, self._streams = self._streams, None
        for s in (streams or {}).values():
            s.close()

    def run(self, tasks: list[Task], compute: Callable[[Task], None],
            transfer: Callable[[Task], Callable[[], None]], stage_io: StageIO | None = None) -> None:
        """`transfer(task)` returns the function a stream runs for a transfer task; `stage_io`: the
        rank's pipeline-stage traffic, around the compute tasks (none without pipeline stages)."""
        failure: Future = Future()
        task_timing, timing = self.task_timing, self.timing
        tx_end: dict[Task, float] = {}  # when each transfer ended

        def done(stream: str, task: Task, end: float) -> None:
            tx_end[task] = end

        streams, self._streams = self._streams, None  # held by this run until it succeeds
        if streams is None:
            streams = {name: self.make_stream(name, self.recorder, failure, done) for name in self.STREAMS}
        else:
            for s in streams.values():
                s.begin(failure, done)
        self.executed = []  # a new list: the previous run's stays with whoever read it
        self.ready = lambda task: streams[task.stream].ready.pop(task, time.perf_counter())
        futures: dict[Task, Future] = {}

        def wait(fut: Future) -> None:
            # A failed transfer on one stream can leave the other stream (and so `fut`) blocked
            # on peers that wait for the failed one: wake up on either.
            futures_wait([fut, failure], return_when=FIRST_COMPLETED)
            if failure.done():
                failure.result()
            fut.result()

        # the previous compute's end
        last_end = task_timing.origin() if task_timing is not None else time.perf_counter()
        try:
            self.meter.__enter__()
            for t in tasks:
                if t.is_comm:
                    futures[t] = streams[t.stream].submit(t, transfer(t), last_end)
                    continue
                need = inputs(t, self.L)
                if need is not None:
                    wait(futures[need])
                    streams[need.stream].consume(need)
                # When emulating, a task's time starts when it could (the previous task ended and
                # its input arrived), as in the simulator: the host's delay in getting to it and
                # the real work both run inside its emulated time.
                ready = max(last_end, tx_end.get(need, last_end))
                arrived = stage_io.receive(t, last_end) if stage_io is not None else None
                if arrived is not None:
                    ready = max(ready, arrived)
                t0 = time.perf_counter()
                run_compute(t, compute, timing)
                if task_timing is not None:
                    t0 = min(t0, ready)
                    last_end = task_timing.compute(t, t0, time.perf_counter())
                else:
                    last_end = time.perf_counter()
                if stage_io is not None:
                    stage_io.send(t, last_end)
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
                if self.keep_streams:
                    s.flush()
                else:
                    s.close()
            if self.keep_streams:
                self._streams = streams
        finally:
            self.meter.__exit__(None, None, None)
        self.executed_streams = {k: s.executed for k, s in streams.items()}
        if timing is not None:
            timing.resolve(self.recorder)  # the step's one host wait; after close() ordered every transfer


class ActivationMeter:
    """Peak bytes of tensors saved for backward (activations; parameters excluded), tracked
    with autograd's saved-tensor hooks: a tensor counts from when it is saved until autograd
    drops it, within one step. At the step's end (__exit__) the finalizers of tensors still alive
    (a saved alias of a weight outlives the graph) are detached, so nothing of a step's meter
    outlives it: a long run's host memory stays flat.

    `enabled` (set before a step): whether the step is metered at all; off, no hook is installed
    (a finalizer per saved tensor is the cost) and `peak` stays 0. Each metered step starts
    from 0: an executor, and its meter, serve every step of a run."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()
        self._finalizers: list[weakref.finalize] = []
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or id(t) in self._ids:
            return t
        n = t.numel() * t.element_size()
        self._ids.add(id(t))
        self.live += n
        self.peak = max(self.peak, self.live)
        self._finalizers.append(weakref.finalize(t, self._free, id(t), n))
        return t

    def _free(self, key: int, n: int) -> None:
        self._ids.discard(key)
        self.live -= n

    def __enter__(self):
        self.live = self.peak = 0
        if self.enabled:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._ids.clear()
