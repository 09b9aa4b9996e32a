"""One issuing thread: a rank's step issued by the thread that runs its compute, every
collective asynchronous (`async_op=True`), in the rank's issue sequence
(plan/issue_order.py `issue_sequence`).

The other executor (schedules/executor.py, `TaskExecutor`) gives each stream a worker thread
that blocks in its collectives; NCCL forbids issuing from several threads at once to
communicators of one device, so that one runs on CPU ranks (gloo) and emulated clusters only.
This one has no worker thread and no choice of order: it walks the sequence, which holds the
rank's compute tasks, counts exchanges, token transfers and pipeline calls in an order that
every rank sharing a collective agrees on (the sequence's docstring says why that is needed on a
GPU: with CUDA_DEVICE_MAX_CONNECTIONS=1 a rank's streams share one hardware queue, and two ranks
issuing two collectives in opposite orders hang). For each item:
* a counts exchange is issued at once, on the ZP group's counts communicator;
* a token transfer is issued on its direction's communicator; a D_F's payload first waits until
  its counts are on the host (the route's split sizes), the only wait the host ever does on a
  CUDA rank (the sequence puts it one compute task after the counts, which the device runs
  meanwhile);
* a pipeline call is posted as one batch (zebra.py `_PipelineNeighbours.issue`);
* a compute task first waits until the transfer `inputs()` names has arrived (a CPU rank) or
  orders its stream after it (a CUDA rank), and its pipeline receive likewise, then runs (CPU)
  or is enqueued (CUDA).
Deadlock freedom is the sequence's: every collective's members issue it in one global order,
and each item waits only for items before it in that order.

Host synchronization on CUDA: none inside the step except the counts. A counts exchange runs
on a side stream after a producer event, is copied to pinned host memory there, and the host
polls that copy's event (`query()`, never a blocking wait) before it issues the payload. Each
transfer (and its counts) waits on the device for a producer event recorded on the compute
stream at the transfer's place in the task list (right after the compute task that fills its
buffer), not at its later place in the sequence; the consumer's compute stream waits on the
transfer's done event right before the consumer is enqueued (`Ticket.consume`). Tensors crossing
streams are held as in executor.py's docstring.

The CUDA calls go through executor.CudaApi, so tests drive them with fake streams and events
(tests/schedules/test_issuer.py); on CPU ranks the same executor runs over gloo's async
collectives (tests/integration/test_single_issuer.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from megatron_hetermoe.parallel.extension import TaskTiming
from megatron_hetermoe.plan.issue_order import Counts, Issue, PipeCall
from megatron_hetermoe.plan.tasks import Layers, Task, inputs
from megatron_hetermoe.schedules.executor import (
    CUDA,
    ActivationMeter,
    CudaApi,
    CudaTiming,
    StageIO,
    TaskExecutor,
    run_compute,
)
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.vocabulary import TaskKind

WAKE_TIMEOUT_S = 0.05  # a host wait rechecks at least this often (see `until`)


class IssueOps(Protocol):
    """What a rank gives the single issuer (zebra.ZebraRank)."""

    def counts(self, c: Counts) -> tuple[torch.Tensor, Any]:
        """Issue the counts exchange `c` asynchronously: (received counts, Work)."""

    def routed(self, c: Counts, counts: torch.Tensor) -> None:
        """`c`'s counts are on the host: make the route of its (layer, microbatch)."""

    def transfer(self, t: Task) -> list:
        """Issue token transfer `t` asynchronously (its route exists); returns its Work objects."""


@dataclass
class Ticket:
    """An issued collective. `arrived()`: the host may read its result (a CPU rank: the works
    completed; a CUDA rank: always, its consumer is ordered on the device by `consume`)."""
    arrived: Callable[[], bool]
    consume: Callable[[], None]  # right before the compute task that reads the result
    value: Any = None  # a counts exchange: the host tensor of the received counts
    works: list = field(default_factory=list)
    keep: Any = None  # a device tensor a pending copy still reads


def _wait_all(works: list) -> None:
    for w in works:
        w.wait()  # re-raises a failed collective's error


class HostTransport:
    """A CPU rank: gloo's async collectives run on gloo's own threads. Each collective's future
    sets `wake` when it completes, so the issuing thread blocks on that one event until some
    collective it may be waiting for completed, never sleeping a guessed time."""

    def __init__(self):
        self.wake = threading.Event()

    def mark(self) -> None:
        """A CPU rank's compute is done when its task returns: nothing to mark."""

    def _arrived(self, works: list) -> Callable[[], bool]:
        """arrived(): every one of `works` completed; each completion sets `wake`."""
        checks = []
        for w in works:
            get_future = getattr(w, "get_future", None)
            if get_future is None:  # a Work without a future (loopback's, done on creation)
                checks.append(w.is_completed)
                continue
            fut = get_future()
            fut.add_done_callback(lambda _: self.wake.set())
            # The future's done(), not Work.is_completed(): gloo completes the future (running
            # the callback) before it marks the Work completed, and a waiter woken in between
            # must see the arrival. The output is final once the future is done.
            checks.append(fut.done)
        return lambda: all(c() for c in checks)

    def counts(self, fn: Callable[[], tuple], producer: None = None) -> Ticket:
        recv, work = fn()
        return Ticket(arrived=self._arrived([work]), consume=lambda: work.wait(), value=recv, works=[work])

    def launch(self, task: Task, fn: Callable[[], list], producer: None = None) -> Ticket:
        works = fn()
        return Ticket(arrived=self._arrived(works), consume=lambda: _wait_all(works), works=works)

    def close(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            _wait_all(t.works)


class CudaTransport:
    """A CUDA rank: collectives issued on a side stream per communicator after a producer event,
    ordered against the compute stream by events; the counts copied to pinned host memory."""

    def __init__(self, device: torch.device, api: CudaApi | None = None, timing: CudaTiming | None = None):
        self.device, self.api, self.timing = device, api or CUDA, timing
        self.done: list = []  # every transfer's done event (close() joins the compute stream with them)

    def mark(self):
        """A producer event on the compute stream: after the compute enqueued so far (recorded
        right after the compute task that fills a transfer's buffer, at the transfer's place in
        the task list), so a transfer issued later still overlaps the compute enqueued meanwhile."""
        ev = self.api.event_type()
        ev.record(self.api.current_stream(self.device))
        return ev

    def counts(self, fn: Callable[[], tuple], producer) -> Ticket:
        side = self.api.side_stream(self.device, "counts")
        copied = self.api.event_type()
        with self.api.use_stream(side):
            side.wait_event(producer)
            recv, work = fn()
            work.wait()  # the side stream waits for the collective (no host wait)
            host = self.api.host_copy(recv)  # non-blocking copy to pinned memory, on the side stream
            copied.record(side)
        return Ticket(arrived=copied.query, consume=lambda: None, value=host, works=[work], keep=recv)

    def launch(self, task: Task, fn: Callable[[], list], producer) -> Ticket:
        side, timing = self.api.side_stream(self.device, task.stream), self.timing
        done = self.api.event_type() if timing is None else timing.event()
        with self.api.use_stream(side):
            side.wait_event(producer)
            if timing is not None:
                start = timing.event()
                start.record(side)
            works = fn()
            for w in works:
                w.wait()  # the side stream waits for the collective (no host wait)
            done.record(side)
        if timing is not None:
            timing.add(task.stream, task, start, done)
        self.done.append(done)
        consume = lambda: self.api.current_stream(self.device).wait_event(done)  # noqa: E731
        return Ticket(arrived=lambda: True, consume=consume, works=works)

    def close(self, tickets: list[Ticket]) -> None:
        compute = self.api.current_stream(self.device)
        for done in self.done:
            compute.wait_event(done)  # what runs after the step is ordered after all its transfers
        self.done.clear()


def fills(tasks: list[Task]) -> dict[Task | None, list[Task | Counts]]:
    """compute task -> the collectives its list places right after it (before the next compute):
    the ones whose buffers it fills; None -> those before the first compute task."""
    out: dict[Task | None, list[Task | Counts]] = {}
    last: Task | None = None
    for t in tasks:
        if not t.is_comm:
            last = t
            continue
        out.setdefault(last, []).extend([Counts(t.layer, t.microbatch), t] if t.kind == TaskKind.D_F else [t])
    return out


class IssueExecutor:
    """Runs one rank's issue sequence from one thread (see the module docstring)."""

    def __init__(self, num_layers: Layers, recorder: TimelineRecorder | None,
                 device: torch.device = torch.device("cpu"), api: CudaApi | None = None):
        self.L, self.recorder, self.device = num_layers, recorder, torch.device(device)
        self.timing = CudaTiming(self.device, api) if self.device.type == "cuda" and recorder is not None else None
        self.transport = (CudaTransport(self.device, api, self.timing) if self.device.type == "cuda"
                          else HostTransport())
        self.executed: list[Task] = []
        self.executed_streams: dict[str, list[Task]] = {}
        self.issued_order: list[Issue] = []  # every collective of the last run, in issue order
        self.meter = ActivationMeter()
        self.polls = 0  # host waits that found nothing arrived (tests read it)

    def close(self) -> None:
        """Nothing outlives a run: no thread, no pending collective (run() waited them all)."""

    def run(self, tasks: list[Task], sequence: list[Issue], compute: Callable[[Task], None], ops: IssueOps,
            stage_io: StageIO | None = None) -> None:
        """`tasks`: the rank's task list, `sequence` its issue sequence (plan.issue_order), `ops`
        what issues its collectives; `stage_io`: the rank's pipeline-stage traffic (its calls
        are items of the sequence; its receives are waited before their consumer)."""
        transport, timing, recorder = self.transport, self.timing, self.recorder
        filled = fills(tasks)
        producer: dict[Task | Counts, Any] = {}
        counts: dict[Counts, Ticket] = {}
        issued: dict[Task, Ticket] = {}
        issued_at: dict[Task, float] = {}
        streams_done: dict[str, list[Task]] = {"dispatch": [], "combine": []}
        wake: threading.Event | None = getattr(transport, "wake", None)

        def mark_after(t: Task | None) -> None:
            if t in filled:  # these collectives' buffers are filled: the device waits for this point
                ev = transport.mark()
                for c in filled[t]:
                    producer[c] = ev

        def until(cond: Callable[[], bool]) -> None:
            delay = 0.0
            while True:
                if wake is not None:
                    wake.clear()  # before the check: a completion after it sets it again
                if cond():
                    return
                self.polls += 1
                if wake is not None:
                    # Only a completion can make cond() true (the futures set `wake`); the
                    # timeout only bounds a wait whose wake-up went missing.
                    wake.wait(WAKE_TIMEOUT_S)
                    continue
                time.sleep(delay)  # CUDA: the counts' copy events can only be queried
                delay = min(max(2 * delay, 2e-5), 1e-3)

        def record_transfer(t: Task) -> None:
            # CPU rank: from its issue to when this thread saw it arrive (host clock).
            if recorder is not None and timing is None and t in issued_at:
                recorder.record(t.stream, t.kind, t.layer, t.microbatch, issued_at.pop(t), time.perf_counter())

        self.executed, self.issued_order = [], []  # new lists: the previous run's stay with whoever read them
        self.meter.__enter__()
        try:
            mark_after(None)
            for item in sequence:
                if isinstance(item, Counts):
                    counts[item] = transport.counts(lambda c=item: ops.counts(c), producer[item])
                    self.issued_order.append(item)
                elif isinstance(item, PipeCall):
                    stage_io.issue(item)
                    self.issued_order.append(item)
                elif item.is_comm:
                    if item.kind == TaskKind.D_F:
                        c = Counts(item.layer, item.microbatch)
                        until(counts[c].arrived)
                        counts[c].consume()  # a CPU rank: re-raises a failed counts exchange
                        ops.routed(c, counts[c].value)
                    issued_at[item] = time.perf_counter()
                    issued[item] = transport.launch(item, lambda t=item: ops.transfer(t), producer[item])
                    streams_done[item.stream].append(item)
                    self.issued_order.append(item)
                else:
                    need = inputs(item, self.L)
                    if need is not None:
                        until(issued[need].arrived)
                        issued[need].consume()
                        record_transfer(need)
                    if stage_io is not None:
                        stage_io.receive(item, time.perf_counter())
                    t0 = time.perf_counter()
                    run_compute(item, compute, timing)
                    mark_after(item)
                    self.executed.append(item)
                    if recorder is not None:
                        recorder.record("compute", item.kind, item.layer, item.microbatch, t0, time.perf_counter())
                    if stage_io is not None:
                        stage_io.send(item, time.perf_counter())
            until(lambda: all(k.arrived() for k in issued.values()))
            for t in list(issued_at):
                record_transfer(t)
            transport.close(list(issued.values()))
        finally:
            self.meter.__exit__(None, None, None)
        self.executed_streams = streams_done
        if timing is not None:
            timing.resolve(recorder)  # the step's one host wait; after close() ordered every transfer


def resolve_issuer(issuer: str, device, emulated: bool, backend: str) -> str:
    """"single" or "threads" for --hetero-zebra-issuer `issuer` on a rank of `device` whose
    transfers run on `backend`; "auto": one issuing thread over NCCL, a worker thread per stream
    otherwise (CPU ranks, emulated clusters, CUDA tensors over gloo). NCCL gets the single issuer
    only: the threaded executor issues from a thread per stream, and NCCL does not allow several
    threads to issue to communicators of one device at once. An emulated cluster needs the threads
    (emulated transfers sleep in their stream's thread), so it runs on gloo."""
    cuda, nccl = torch.device(device).type == "cuda", backend == "nccl"
    if issuer == "single" and cuda and not nccl:
        # CudaTransport relies on NCCL's Work.wait() ordering a stream; gloo's blocks the host,
        # which one issuing thread cannot afford.
        raise ValueError(f"--hetero-zebra-issuer single on a CUDA rank needs NCCL, not {backend}; pass threads")
    if issuer == "single" and emulated:
        raise ValueError("--hetero-zebra-issuer single cannot emulate a cluster (emulated transfers sleep in their "
                         "stream's thread); drop --hetero-zebra-issuer or pass threads")
    if nccl and issuer == "threads":
        raise ValueError("--hetero-zebra-issuer threads on NCCL: that executor issues collectives from a thread per "
                         "stream, and NCCL does not allow several threads to issue to communicators of one device at "
                         "once; drop the flag (NCCL ranks use the single issuer)")
    if nccl and emulated:
        raise ValueError("an emulated cluster on NCCL ranks: emulation needs the threaded executor, which NCCL "
                         "does not allow (several issuing threads); emulate on CPU ranks (gloo)")
    if issuer != "auto":
        return issuer
    return "single" if cuda and nccl else "threads"


def make_executor(num_layers: Layers, issuer: str, recorder: TimelineRecorder | None, device: torch.device,
                  backend: str, task_timing: TaskTiming | None = None,
                  keep_streams: bool = False) -> IssueExecutor | TaskExecutor:
    """The executor `issuer` names (resolve_issuer); `task_timing`: emulated task times;
    `keep_streams`: the threaded executor keeps its stream workers between runs (TaskExecutor)."""
    if resolve_issuer(issuer, device, task_timing is not None, backend) == "single":
        return IssueExecutor(num_layers, recorder, device=device)
    return TaskExecutor(num_layers, recorder, task_timing, device=device, keep_streams=keep_streams)
