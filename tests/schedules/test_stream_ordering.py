"""CudaStream's event ordering, driven on CPU with fake CUDA streams and events.

A fake stream/event pair logs every record / wait_event into one global log (with the thread
and the stream current in it), so the tests can check the order the CUDA runtime would see:
the transfer waits on the producer event recorded at submit time, the consumer's compute stream
waits on the transfer's done event before its compute task is enqueued, each stream's transfers
run in FIFO order on their own stream and thread, and nothing synchronizes the host.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from fake_streams import CASES, ThreadStreams, num_layers

from megatron_hetermoe.plan.tasks import (
    inputs,
    zebra_tasks_for_role,
)
from megatron_hetermoe.schedules import executor as ex_mod
from megatron_hetermoe.schedules.executor import (
    CudaApi,
    CudaStream,
    TaskExecutor,
    ThreadStream,
    stream_factory,
)

DEVICE = torch.device("cuda", 3)


class Log:
    def __init__(self):
        self.lock = threading.Lock()
        self.items: list[tuple] = []

    def add(self, *item) -> int:
        with self.lock:
            self.items.append(item)
            return len(self.items) - 1

    def index(self, pred) -> list[int]:
        return [i for i, it in enumerate(self.items) if pred(it)]


class FakeEvent:
    n = 0

    def __init__(self, log: Log):
        FakeEvent.n += 1
        self.id, self.log = FakeEvent.n, log
        self.recorded_on = None

    def record(self, stream) -> None:
        self.recorded_on = stream.name
        self.log.add("record", self.id, stream.name, threading.current_thread().name)

    def synchronize(self):  # a host sync: must never be called
        self.log.add("HOST_SYNC", "event", self.id)

    def query(self):
        return True


class FakeStream:
    def __init__(self, log: Log, name: str, device=None):
        self.log, self.name, self.device = log, name, device

    def wait_event(self, ev: FakeEvent) -> None:
        # On CUDA, waiting an event that was never recorded is a no-op: an ordering bug.
        assert ev.recorded_on is not None, f"{self.name} waits event {ev.id} before it was recorded"
        self.log.add("wait", self.name, ev.id, threading.current_thread().name)

    def synchronize(self):
        self.log.add("HOST_SYNC", "stream", self.name)


class FakeCuda(ThreadStreams):
    """A CudaApi over fake streams: the compute thread's current stream is 'compute', a worker
    thread's is 'default' until it enters use_stream."""

    def __init__(self):
        self.log = Log()
        super().__init__()
        self.compute = FakeStream(self.log, "compute")
        self.default = FakeStream(self.log, "default")
        self.made: list[FakeStream] = []
        self.device_of_thread: dict[str, torch.device] = {}
        self.main = threading.current_thread()

        def stream_type(device=None):
            s = FakeStream(self.log, f"side{len(self.made)}", device)
            self.made.append(s)
            return s

        self.api = CudaApi(stream_type=stream_type, event_type=lambda: FakeEvent(self.log),
                           current_stream=self.current_stream, use_stream=self.use_stream,
                           set_device=self.set_device)

    def current_stream(self, device=None):
        assert device == DEVICE
        s = self.thread_stream()
        if s is None:
            s = self.compute if threading.current_thread() is self.main else self.default
        return s

    def set_device(self, device):
        self.device_of_thread[threading.current_thread().name] = device


@pytest.fixture
def fake(monkeypatch):
    f = FakeCuda()

    def no_sync(*a, **k):
        f.log.add("HOST_SYNC", "torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    return f


def _run(fake: FakeCuda, tasks, L: int, jitter: bool = True):
    exe = TaskExecutor(L, None, make_stream=stream_factory(DEVICE, fake.api))
    rnd = random.Random(0)

    def compute(t):
        # What the compute task enqueues goes to the compute thread's current stream.
        fake.log.add("compute", t, fake.current_stream(DEVICE).name, threading.current_thread().name)

    def transfer(t):
        def fn():
            if jitter:
                time.sleep(rnd.random() * 0.002)  # let the two streams' threads interleave
            fake.log.add("transfer", t, fake.current_stream(DEVICE).name, threading.current_thread().name)
            return t

        return fn

    exe.run(tasks, compute, transfer)
    return exe


def _events(fake):
    """event id -> (index of its record, stream it was recorded on)."""
    return {it[1]: (i, it[2]) for i, it in enumerate(fake.log.items) if it[0] == "record"}




@pytest.mark.parametrize("name, tasks", CASES, ids=[c[0] for c in CASES])
def test_cuda_stream_ordering(fake, name, tasks):
    L = num_layers(tasks)
    exe = _run(fake, tasks, L)
    log = fake.log.items
    rec = _events(fake)
    side = {s.name for s in fake.made}
    assert len(side) == 2  # one side stream per stream name
    where = {}  # transfer -> (log index, stream, thread)
    for i, it in enumerate(log):
        if it[0] == "transfer":
            where[it[1]] = (i, it[2], it[3])
    computes = {it[1]: i for i, it in enumerate(log) if it[0] == "compute"}

    # Compute runs on the compute thread's current stream, in list order.
    assert [it[1] for it in log if it[0] == "compute"] == [t for t in tasks if not t.is_comm]
    assert all(it[2] == "compute" for it in log if it[0] == "compute")

    # Each transfer: on its side stream (not the compute or default stream), its own worker
    # thread, which called set_device(DEVICE) first; FIFO per stream.
    by_stream: dict[str, str] = {}
    threads: dict[str, str] = {}
    for t in tasks:
        if not t.is_comm:
            continue
        _, s, th = where[t]
        assert s in side, (t, s)
        assert by_stream.setdefault(t.stream, s) == s
        assert threads.setdefault(t.stream, th) == th
        assert fake.device_of_thread[th] == DEVICE
    assert by_stream["dispatch"] != by_stream["combine"] and threads["dispatch"] != threads["combine"]
    for lane in ("dispatch", "combine"):
        want = [t for t in tasks if t.is_comm and t.stream == lane]
        assert sorted(want, key=lambda t: where[t][0]) == want, f"{lane} not FIFO"
        assert exe.executed_streams[lane] == want

    # The producer event: recorded on the compute stream at submit time, i.e. after the compute
    # task just before the transfer in the list and before the next one; the side stream waits
    # on it right before the transfer runs.
    for k, t in enumerate(tasks):
        if not t.is_comm:
            continue
        i_tx, s, _ = where[t]
        waits = [i for i in range(i_tx) if log[i][0] == "wait" and log[i][1] == s]
        assert waits, t
        ev = log[waits[-1]][2]
        i_rec, on = rec[ev]
        assert on == "compute"
        prev = [u for u in tasks[:k] if not u.is_comm]
        nxt = [u for u in tasks[k + 1:] if not u.is_comm]
        if prev:
            assert computes[prev[-1]] < i_rec, (t, "producer event before its producer")
        if nxt:
            assert i_rec < computes[nxt[0]], (t, "producer event recorded late")
        # nothing else on that side stream between the wait and the transfer
        assert not [i for i in range(waits[-1] + 1, i_tx) if log[i][0] == "transfer" and log[i][2] == s]

    # The done event: recorded on the side stream after the transfer; the compute stream waits on
    # it before the consumer's compute; every done event is waited by the end of run (close).
    done_of = {}
    for t, (i_tx, s, _) in where.items():
        after = [i for i in range(i_tx + 1, len(log)) if log[i][0] == "record" and log[i][2] == s]
        done_of[t] = log[after[0]][1]
    compute_waits = {it[2]: i for i, it in enumerate(log) if it[0] == "wait" and it[1] == "compute"}
    for t in tasks:
        need = None if t.is_comm else inputs(t, L)
        if need is None:
            continue
        ev = done_of[need]
        assert ev in compute_waits, (t, need)
        assert rec[ev][0] < compute_waits[ev] < computes[t], (t, need)
        prev = [u for u in tasks[:tasks.index(t)] if not u.is_comm]
        if prev:  # waited right before the dependent compute, not earlier
            assert computes[prev[-1]] < compute_waits[ev]
    assert set(done_of.values()) <= set(compute_waits), "close() must join every done event"

    # No host synchronize anywhere.
    assert not [it for it in log if it[0] == "HOST_SYNC"]


def test_side_streams_are_made_once_per_device_and_name(fake):
    tasks = zebra_tasks_for_role(2, 2, "expert")
    _run(fake, tasks, 2, jitter=False)
    _run(fake, tasks, 2, jitter=False)
    assert len(fake.made) == 2
    assert {s.device for s in fake.made} == {DEVICE}


def test_executor_picks_the_stream_from_the_device():
    assert TaskExecutor(2, None).make_stream is ThreadStream
    assert TaskExecutor(2, None, device=torch.device("cpu")).make_stream is ThreadStream
    f = TaskExecutor(2, None, device=torch.device("cuda", 1)).make_stream
    assert f.func is CudaStream and f.keywords["device"] == torch.device("cuda", 1)
    assert f.keywords["api"] is None  # the real torch.cuda (ex_mod.CUDA) at construction
    assert isinstance(ex_mod.CUDA, CudaApi)


def test_failed_transfer_surfaces_and_nothing_waits_an_unrecorded_event(fake):
    tasks = zebra_tasks_for_role(1, 2, "expert")
    exe = TaskExecutor(1, None, make_stream=stream_factory(DEVICE, fake.api))

    def transfer(t):
        def fn():
            if t.kind == "C_F":
                raise RuntimeError("peer died")
        return fn

    with pytest.raises(RuntimeError, match="peer died"):
        exe.run(tasks, lambda t: None, transfer)
    assert not [it for it in fake.log.items if it[0] == "HOST_SYNC"]
