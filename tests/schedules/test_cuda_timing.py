"""CUDA-event timing of a CUDA rank's task list, driven on CPU with a simulated CUDA device.

`SimCuda` is a CudaApi whose streams keep a device clock (ms): work enqueued on a stream moves
its clock, `wait_event` moves it to the event's time, an event recorded on a stream takes the
stream's clock. So every event's device time follows from the task list alone (a reference
simulation below computes it independently of the executor), whatever the host threads'
interleaving. The tests check that the timeline's "cuda" spans are exactly those device times
placed on the host axis backwards from the step's one host wait, that the host waits once per
step and never inside it, that busy() and the logged utilization use the CUDA spans, and that
CPU ranks and emulated runs are unchanged (host clock only).
"""
from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fake_streams import CASES, ThreadStreams, num_layers

from megatron_hetermoe.emulation.timing import EmulatedTiming
from megatron_hetermoe.plan.tasks import (
    inputs,
    zebra_tasks_for_role,
)
from megatron_hetermoe.schedules.executor import CudaApi, TaskExecutor
from megatron_hetermoe.schedules.timeline import Event, TimelineRecorder, load_events
from megatron_hetermoe.tools.timeline import chrome_trace
from megatron_hetermoe.training.logging import StepLogger, last_step_busy

DEVICE = torch.device("cuda", 1)
NOW = 1000.0  # the host clock when the step's host wait returns (CudaTiming.host_clock)
DUR = {"A_F": 3, "A_B": 5, "X_F": 4, "X_B": 6, "E_F": 4, "E_B": 7, "D_F": 2, "C_F": 2, "C_B": 3, "D_B": 1}


def dur(t) -> int:
    """Device milliseconds of a task's work (integers: every event time is exact)."""
    return DUR[t.kind] + t.layer + 2 * t.microbatch


class SimStream:
    def __init__(self, sim: "SimCuda", name: str):
        self.sim, self.name, self.t = sim, name, 0

    def wait_event(self, ev: "SimEvent") -> None:
        assert ev.t is not None, f"{self.name} waits an unrecorded event"
        with self.sim.lock:
            self.t = max(self.t, ev.t)

    def synchronize(self):
        self.sim.log("HOST_SYNC", "stream")


class SimEvent:
    def __init__(self, sim: "SimCuda", timing: bool):
        self.sim, self.timing, self.t = sim, timing, None

    def record(self, stream: SimStream) -> None:
        with self.sim.lock:
            self.t = stream.t
        self.sim.log("record", stream.name, self.timing)

    def elapsed_time(self, end: "SimEvent") -> float:
        # torch.cuda.Event.elapsed_time: both events need enable_timing and must have completed.
        assert self.timing and end.timing, "elapsed_time of an event made without enable_timing"
        assert self.t is not None and end.t is not None
        assert self.sim.synced, "elapsed_time before the host waited for the step"
        return float(end.t - self.t)

    def synchronize(self) -> None:
        self.sim.log("HOST_SYNC", "event")
        self.sim.synced = True

    def query(self):
        return True


class SimCuda(ThreadStreams):
    def __init__(self):
        self.lock = threading.Lock()
        self.items: list[tuple] = []
        super().__init__()
        self.main = threading.current_thread()
        self.compute = SimStream(self, "compute")
        self.defaults: dict[str, SimStream] = {}
        self.side: list[SimStream] = []
        self.synced = False

        def stream_type(device=None):
            assert device == DEVICE
            s = SimStream(self, f"side{len(self.side)}")
            self.side.append(s)
            return s

        self.api = CudaApi(stream_type=stream_type, event_type=lambda: SimEvent(self, False),
                           current_stream=self.current_stream, use_stream=self.use_stream,
                           set_device=lambda d: None, timing_event_type=lambda: SimEvent(self, True))

    def log(self, *item) -> None:
        with self.lock:
            self.items.append(item)

    def current_stream(self, device=None) -> SimStream:
        assert device == DEVICE
        s = self.thread_stream()
        if s is None:
            if threading.current_thread() is self.main:
                return self.compute
            name = threading.current_thread().name
            s = self.defaults.setdefault(name, SimStream(self, f"default-{name}"))
        return s

    def work(self, t) -> None:
        """Enqueue `t`'s work on this thread's current stream."""
        s = self.current_stream(DEVICE)
        with self.lock:
            s.t += dur(t)
        self.log("work", t, s.name)


@pytest.fixture
def sim(monkeypatch):
    s = SimCuda()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: s.log("HOST_SYNC", "torch.cuda.synchronize"))
    return s


def reference(tasks, L: int) -> tuple[dict, int]:
    """Device (start, end) in ms of every task, and the anchor's time, by CUDA's stream rules:
    a transfer starts on its lane when the compute enqueued before it is done and its lane is
    free; a compute task when the previous one and its input transfer are done."""
    c, lane, span = 0, {"dispatch": 0, "combine": 0}, {}
    for t in tasks:
        if t.is_comm:
            s = max(lane[t.stream], c)  # the producer event: the compute stream's clock at submit
            lane[t.stream] = s + dur(t)
            span[t] = (s, lane[t.stream])
        else:
            need = inputs(t, L)
            if need is not None:
                c = max(c, span[need][1])
            span[t] = (c, c + dur(t))
            c += dur(t)
    anchor = max([c] + [e for s, e in span.values()])  # close() joins every transfer's done event
    return span, anchor


def expected_events(tasks, L: int, step: int = 0) -> dict:
    span, anchor = reference(tasks, L)
    out = {}
    for t, (s, e) in span.items():
        lane = t.stream if t.is_comm else "compute"
        out[(lane, t.kind, t.layer, t.microbatch)] = (NOW - float(anchor - s) / 1e3, NOW - float(anchor - e) / 1e3)
    return out


def run_step(sim: SimCuda, tasks, L: int, recorder: TimelineRecorder, timing: EmulatedTiming | None = None,
             jitter: bool = True) -> TaskExecutor:
    exe = TaskExecutor(L, recorder, timing, device=DEVICE, api=sim.api)
    if exe.timing is not None:
        exe.timing.host_clock = lambda: NOW
    rnd = random.Random(recorder.step)

    def transfer(t):
        def fn():
            if jitter:
                time.sleep(rnd.random() * 0.002)  # interleave the two streams' threads
            sim.work(t)

        return fn

    sim.synced = False
    exe.run(tasks, sim.work, transfer)
    return exe




@pytest.mark.parametrize("name, tasks", CASES, ids=[c[0] for c in CASES])
def test_cuda_spans_are_the_device_times_on_the_host_axis(sim, name, tasks):
    L = num_layers(tasks)
    rec = TimelineRecorder(0, "attention")
    run_step(sim, tasks, L, rec)
    cuda = [e for e in rec.events if e.clock == "cuda"]
    host = [e for e in rec.events if e.clock == "host"]
    got = {(e.lane, e.kind, e.layer, e.microbatch): (e.start, e.end) for e in cuda}
    assert len(got) == len(cuda) == len(tasks)  # every task once
    assert got == expected_events(tasks, L)  # exactly, not approximately
    # The host clock's events are still there, one per task (when the host ran or issued it).
    assert sorted((e.lane, e.kind, e.layer, e.microbatch) for e in host) == sorted(got)
    # Each span's events were recorded on the stream its work ran on: the compute stream for
    # compute tasks, the transfer's side stream (after its producer wait) for transfers.
    # (Each stream's entries come from one thread: its own order is deterministic.)
    for stream in {it[2] for it in sim.items if it[0] == "work"}:
        seq = [it for it in sim.items if it[0] in ("work", "record") and it[1 if it[0] == "record" else 2] == stream]
        for k, it in enumerate(seq):
            if it[0] == "work":
                assert seq[k - 1] == ("record", stream, True) and seq[k + 1] == ("record", stream, True), it


def test_one_host_wait_per_step_after_the_step(sim):
    tasks = zebra_tasks_for_role(2, 3, "attention")
    L = num_layers(tasks)
    rec = TimelineRecorder(0, "attention")
    bounds = []
    for step in range(3):
        rec.step = step
        begin = len(sim.items)
        run_step(sim, tasks, L, rec)
        bounds.append((begin, len(sim.items)))
    syncs = [i for i, it in enumerate(sim.items) if it[0] == "HOST_SYNC"]
    assert len(syncs) == 3
    assert all(sim.items[i][1] == "event" for i in syncs)  # an event's wait, not a device-wide one
    for (begin, end), i in zip(bounds, syncs):
        assert begin <= i < end
        work = [k for k in range(begin, end) if sim.items[k][0] in ("work", "record") and k != i - 1]
        assert max(work) < i - 1, "the host waited inside the step"
        assert sim.items[i - 1] == ("record", "compute", True)  # the anchor, right before its wait
    for step in range(3):
        got = {(e.lane, e.kind, e.layer, e.microbatch): (e.start, e.end)
               for e in rec.events if e.clock == "cuda" and e.step == step}
        assert got == expected_events(tasks, L)  # the device clocks keep running: same offsets


def test_busy_and_utilization_use_the_cuda_spans(sim, monkeypatch):
    tasks = zebra_tasks_for_role(2, 3, "expert")
    L = num_layers(tasks)
    rec = TimelineRecorder(3, "expert")
    rec.step = 5
    run_step(sim, tasks, L, rec)
    want = expected_events(tasks, L)
    busy = sum(e - s for (lane, *_), (s, e) in want.items() if lane == "compute")
    host_busy = sum(e.end - e.start for e in rec.events if e.clock == "host" and e.lane == "compute")
    assert rec.busy(5) == pytest.approx(busy, rel=1e-12)
    assert busy == pytest.approx(sum(dur(t) for t in tasks if not t.is_comm) / 1e3)
    assert host_busy < 0.5 * busy  # the simulated work takes no host time
    assert rec.busy(4) == 0.0

    # StepLogger and last_step_busy read busy(): a world of one, gathered in place.
    def gather(out, obj, group=None):
        out[0] = obj

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    log = StepLogger(SimpleNamespace(tensorboard_dir=None), "expert", rec, None, True)
    assert log.utilization(5, 2 * busy) == {"expert": pytest.approx(0.5, rel=1e-12)}
    assert last_step_busy(rec, 5, None) == [rec.busy(5)]


def test_busy_falls_back_to_host_times():
    rec = TimelineRecorder(0, "expert")
    rec.record("compute", "E_F", 0, 0, 1.0, 1.5)
    rec.record("dispatch", "D_F", 0, 0, 0.0, 1.0)
    assert rec.busy(0) == 0.5
    rec.record("compute", "E_F", 0, 0, 1.0, 1.25, clock="cuda")
    assert rec.busy(0) == 0.25  # the step has CUDA spans: only they count
    with pytest.raises(ValueError, match="clock"):
        rec.record("compute", "E_F", 0, 0, 0.0, 1.0, clock="wall")


def test_emulation_and_cpu_ranks_keep_the_host_clock(sim):
    tasks = zebra_tasks_for_role(1, 2, "expert")
    # Emulated (stretched) tasks on a CUDA device: host times only, no host wait.
    rec = TimelineRecorder(0, "expert")
    exe = run_step(sim, tasks, 1, rec, EmulatedTiming(lambda t: 0.0), jitter=False)
    assert exe.timing is None
    assert {e.clock for e in rec.events} == {"host"} and len(rec.events) == len(tasks)
    # No recorder: nothing timed.
    assert TaskExecutor(1, None, device=DEVICE, api=sim.api).timing is None
    assert not [it for it in sim.items if it[0] == "HOST_SYNC" or (it[0] == "record" and it[2])]
    # A CPU rank: host clock only, as before.
    cpu = TimelineRecorder(0, "expert")
    exe = TaskExecutor(1, cpu)
    assert exe.timing is None
    exe.run(tasks, lambda t: None, lambda t: (lambda: None))
    assert {e.clock for e in cpu.events} == {"host"} and len(cpu.events) == len(tasks)


def test_timeline_files_and_trace_name_the_clock(tmp_path):
    rec = TimelineRecorder(0, "attention")
    rec.record("compute", "A_F", 0, 0, 1.0, 2.0)
    rec.record("compute", "A_F", 0, 0, 1.5, 2.5, clock="cuda")
    rec.record("dispatch", "D_F", 0, 0, 2.5, 3.0, clock="cuda")
    rec.save(tmp_path)
    ev = load_events(tmp_path)
    assert [e.clock for e in ev] == ["host", "cuda", "cuda"]
    # A timeline written before the clock field reads as host-timed.
    old = {k: v for k, v in json.loads((tmp_path / "timeline.rank0.json").read_text())[0].items() if k != "clock"}
    (tmp_path / "timeline.rank1.json").write_text(json.dumps([{**old, "rank": 1}]))
    assert [e.clock for e in load_events(tmp_path) if e.rank == 1] == ["host"]

    trace = chrome_trace(ev)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["compute (cuda)", "compute (host)", "dispatch (cuda)"]
    for e in (e for e in trace["traceEvents"] if e["ph"] == "X"):
        assert names[(e["pid"], e["tid"])] == f"{e['cat']} ({e['args']['clock']})"
    assert Event(0, "expert", "compute", "E_F", 0, 0, 0.0, 1.0).clock == "host"
