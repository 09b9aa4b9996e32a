"""One issuing thread: a rank's task list issued in list order by the thread that runs its
compute, every collective asynchronous (`async_op=True`), split sizes exchanged ahead.

The other executor (schedules/executor.py, `TaskExecutor`) gives each stream a worker thread
that blocks in its collectives. This one has no worker thread. For each task of the list, in
order:
* a transfer task is appended to its stream's FIFO ("dispatch" or "combine"). A D_F also
  starts its counts exchange right there, asynchronously, on the ZP group's third
  communicator (`counts_group`): the split sizes of (l, j) are on their way while the rank goes
  on issuing, and they never wait behind the payloads queued on the dispatch group;
* a compute task first waits until the transfer `inputs()` names is issued (and, on a CPU
  rank, has arrived), then runs (CPU) or is enqueued (CUDA).
Between tasks and inside every wait the executor pumps: each stream's head transfer is issued
as soon as its split sizes are on the host (D_F: its counts arrived; C_F/C_B/D_B: the route
its D_F made exists). A stream issues its transfers in FIFO order, so on every communicator
(dispatch, combine, counts) every member issues the same collectives in the same order
(tasks.check_stream_order); across communicators the order is whatever the timing gives,
which is safe while the collectives of the three communicators can be in flight at once.

Deadlock freedom is the threaded executor's: there a stream's worker issues a transfer as soon
as the rank reached it in its list, the stream's earlier transfers were issued and its split
sizes are known, and the compute thread waits only for its input. Here the same transfer is
issued under the same conditions, by the pump, and every host wait returns to pumping as soon
as anything it could issue became ready: no wait can hold back a transfer a peer needs. On a
CPU rank the wait blocks on one event that every collective's completion sets (HostTransport:
what a wait waits for, and what makes a head transfer ready, is always a completion); on a CUDA
rank it polls the counts' copy events with a short sleep back-off. (A CPU compute task cannot be
interrupted; it delays this rank's issuing by its length, as the threaded executor's compute
would delay its submissions. That is why CPU ranks keep the threaded executor by default.)

Host synchronization on CUDA: none inside the step except the counts. A counts exchange runs
on a side stream after a producer event, is copied to pinned host memory there, and the host
polls that copy's event (`query()`, never a blocking wait) before it issues the payload. Token
transfers run on the side stream of their direction after a producer event recorded on the
compute stream at their place in the list (not when they are issued, which may be later); the consumer's compute stream waits on the transfer's done event
right before the consumer is enqueued (`Ticket.consume`). Tensors crossing streams are held
as in executor.py's docstring (Slot keeps them to the end of the step).

The CUDA calls go through executor.CudaApi, so tests drive them with fake streams and events
(tests/schedules/test_issuer.py); on CPU ranks the same executor runs over gloo's async
collectives (tests/integration/test_single_issuer.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_hetermoe.plan.tasks import Task, inputs
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
from megatron_hetermoe.schedules.timing import TaskTiming

STREAMS = ("dispatch", "combine")
WAKE_TIMEOUT_S = 0.05  # a host wait rechecks at least this often (see `until`)


@dataclass
class AsyncTransfer:
    """What a rank gives the issuer for one transfer task, at the task's place in its list."""
    ready: Callable[[], bool]  # its split sizes are on the host: it can be issued now
    launch: Callable[[], list]  # issue its collective(s) asynchronously; returns their Work objects


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
    collective it may be waiting for (an input, a head transfer's counts) completed, never
    sleeping a guessed time."""

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

    def counts(self, fn: Callable[[], tuple]) -> Ticket:
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
        """The producer event of a transfer, recorded at its place in the list: after the compute
        tasks before it (the one that made its send buffer), before those after it. A transfer
        issued later than its place (split sizes still on the way) waits for no more compute
        than that, so it still overlaps the compute enqueued meanwhile."""
        ev = self.api.event_type()
        ev.record(self.api.current_stream(self.device))
        return ev

    def counts(self, fn: Callable[[], tuple]) -> Ticket:
        producer, side = self.mark(), self.api.side_stream(self.device, "counts")
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


class IssueExecutor:
    """Runs one task list from one thread (see the module docstring)."""

    def __init__(self, num_layers: int, recorder: TimelineRecorder | None,
                 device: torch.device = torch.device("cpu"), api: CudaApi | None = None):
        self.L, self.recorder, self.device = num_layers, recorder, torch.device(device)
        self.timing = CudaTiming(self.device, api) if self.device.type == "cuda" and recorder is not None else None
        self.transport = (CudaTransport(self.device, api, self.timing) if self.device.type == "cuda"
                          else HostTransport())
        self.executed: list[Task] = []
        self.executed_streams: dict[str, list[Task]] = {}
        self.meter = ActivationMeter()
        self.polls = 0  # host waits that found nothing to do (tests read it)

    def close(self) -> None:
        """Nothing outlives a run: no thread, no pending collective (run() waited them all)."""

    def run(self, tasks: list[Task], compute: Callable[[Task], None],
            start: Callable[[Task, Callable[[Callable[[], tuple]], Ticket]], AsyncTransfer],
            stage_io: StageIO | None = None) -> None:
        """`start(task, counts)`: the AsyncTransfer of a transfer task, called at its place in the
        list; a D_F calls `counts(fn)` there, fn issuing its async counts exchange and returning
        (received counts, work). `stage_io`: the rank's pipeline-stage traffic, around the compute
        tasks (a receive blocks this thread, as the compute task would)."""
        fifo: dict[str, deque] = {s: deque() for s in STREAMS}
        issued: dict[Task, Ticket] = {}
        issued_at: dict[Task, float] = {}
        streams_done: dict[str, list[Task]] = {s: [] for s in STREAMS}
        transport, timing, recorder = self.transport, self.timing, self.recorder

        def pump() -> bool:
            moved = False
            for name, q in fifo.items():
                while q and q[0][1].ready():
                    t, tr, producer = q.popleft()
                    issued_at[t] = time.perf_counter()
                    issued[t] = transport.launch(t, tr.launch, producer)
                    streams_done[name].append(t)
                    moved = True
            return moved

        wake: threading.Event | None = getattr(transport, "wake", None)

        def until(cond: Callable[[], bool]) -> None:
            delay = 0.0
            while True:
                if wake is not None:
                    wake.clear()  # before the checks: a completion after them sets it again
                if cond():
                    return
                if pump():
                    delay = 0.0
                    continue
                self.polls += 1
                if wake is not None:
                    # Nothing can move until one of this rank's collectives completes: all that
                    # cond() and pump() read is a completion (the futures set `wake`) or made by
                    # this thread. The timeout only bounds a wait whose wake-up went missing.
                    wake.wait(WAKE_TIMEOUT_S)
                    continue
                time.sleep(delay)  # CUDA: the counts' copy events can only be queried
                delay = min(max(2 * delay, 2e-5), 1e-3)

        def record_transfer(t: Task) -> None:
            # CPU rank: from its issue to when this thread saw it arrive (host clock).
            if recorder is not None and timing is None and t in issued_at:
                recorder.record(t.stream, t.kind, t.layer, t.microbatch, issued_at.pop(t), time.perf_counter())

        self.executed = []  # a new list: the previous run's stays with whoever read it
        self.meter.__enter__()
        try:
            for t in tasks:
                if t.is_comm:
                    producer = transport.mark()  # at its place: the counts exchange may start it at once
                    fifo[t.stream].append((t, start(t, transport.counts), producer))
                    pump()
                    continue
                need = inputs(t, self.L)
                if need is not None:
                    until(lambda: need in issued and issued[need].arrived())
                    issued[need].consume()
                    record_transfer(need)
                if stage_io is not None:
                    stage_io.receive(t, time.perf_counter())
                t0 = time.perf_counter()
                run_compute(t, compute, timing)
                self.executed.append(t)
                if recorder is not None:
                    recorder.record("compute", t.kind, t.layer, t.microbatch, t0, time.perf_counter())
                if stage_io is not None:
                    stage_io.send(t, time.perf_counter())
                pump()
            until(lambda: not any(fifo.values()))
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
    transfers run on `backend`; "auto": one issuing thread on a CUDA rank over NCCL that does not
    emulate, a worker thread per stream otherwise (CPU ranks, emulated clusters, CUDA tensors
    over gloo). An emulated cluster needs the threads: emulated transfers sleep in their stream's."""
    cuda = torch.device(device).type == "cuda"
    if issuer == "single" and cuda and backend != "nccl":
        # CudaTransport relies on NCCL's Work.wait() ordering a stream; gloo's blocks the host,
        # which one issuing thread cannot afford (a peer may need a transfer queued behind it).
        raise ValueError(f"--hetero-zebra-issuer single on a CUDA rank needs NCCL, not {backend}; pass threads")
    if issuer == "single" and emulated:
        raise ValueError("--hetero-zebra-issuer single cannot emulate a cluster (emulated transfers sleep in their "
                         "stream's thread); drop --hetero-zebra-issuer or pass threads")
    if issuer != "auto":
        return issuer
    return "single" if cuda and backend == "nccl" and not emulated else "threads"


def make_executor(num_layers: int, issuer: str, recorder: TimelineRecorder | None, device: torch.device,
                  backend: str, task_timing: TaskTiming | None = None,
                  keep_streams: bool = False) -> IssueExecutor | TaskExecutor:
    """The executor `issuer` names (resolve_issuer); `task_timing`: emulated task times;
    `keep_streams`: the threaded executor keeps its stream workers between runs (TaskExecutor)."""
    if resolve_issuer(issuer, device, task_timing is not None, backend) == "single":
        return IssueExecutor(num_layers, recorder, device=device)
    return TaskExecutor(num_layers, recorder, task_timing, device=device, keep_streams=keep_streams)
