"""The single issuer (schedules/issuer.py) on a CUDA rank, driven on CPU with fake streams,
events and collectives: one thread issues everything in the rank's issue sequence
(plan/issue_order.py), whatever the timing; each transfer's side stream waits the producer event
recorded at the transfer's place in the task list; a consumer's compute stream waits the
transfer's done event right before it is enqueued; a D_F's payload is issued only once its counts
reached the host (polled, never a blocking wait); nothing synchronizes the host."""
from __future__ import annotations

import threading

import pytest
import torch
from fake_streams import CASES, ThreadStreams, num_layers, sequence_of

from megatron_hetermoe.config import HeteroRunConfig
from megatron_hetermoe.emulation.timing import EmulatedTiming
from megatron_hetermoe.plan.issue_order import Counts
from megatron_hetermoe.plan.tasks import inputs
from megatron_hetermoe.schedules.executor import CudaApi, TaskExecutor
from megatron_hetermoe.schedules.issuer import IssueExecutor, make_executor
from megatron_hetermoe.training.validation import ConfigError, check_issuer

DEVICE = torch.device("cuda", 1)


class Fake(ThreadStreams):
    """Fake CUDA: every record / wait / launch is one entry of `log`, with the current stream and
    thread. A counts copy's event answers query() False `lag` times before True."""

    def __init__(self, lag: int):
        super().__init__()
        self.log: list[tuple] = []
        self.lag = lag
        self.n_events = 0
        self.compute = self.Stream(self, "compute")
        self.side: dict[str, Fake.Stream] = {}
        self.api = CudaApi(stream_type=self.stream_type, event_type=lambda: self.Event(self),
                           current_stream=self.current, use_stream=self.use_stream,
                           set_device=lambda d: None, host_copy=self.host_copy)

    class Stream:
        def __init__(self, fake, name):
            self.fake, self.name = fake, name

        def wait_event(self, ev):
            assert ev.on is not None, f"{self.name} waits event {ev.id} before it was recorded"
            self.fake.add("wait", self.name, ev.id)

        def synchronize(self):
            self.fake.add("HOST_SYNC")

    class Event:
        def __init__(self, fake):
            fake.n_events += 1
            self.fake, self.id, self.on, self.queries = fake, fake.n_events, None, 0

        def record(self, stream):
            self.on = stream.name
            self.fake.add("record", self.id, stream.name)

        def query(self):
            self.queries += 1
            return self.queries > self.fake.lag

        def synchronize(self):
            self.fake.add("HOST_SYNC")

    class Work:
        def __init__(self, fake, what):
            self.fake, self.what = fake, what

        def wait(self):  # NCCL's: the current stream waits the collective; the host does not
            self.fake.add("work_wait", self.fake.current(DEVICE).name, self.what)

        def is_completed(self):
            return True

    def add(self, *item):
        self.log.append(item + (threading.current_thread().name,))

    def stream_type(self, device=None):
        assert device == DEVICE
        s = self.Stream(self, f"side{len(self.side)}")
        self.side[s.name] = s
        return s

    def current(self, device=None):
        assert device == DEVICE
        return self.thread_stream() or self.compute

    def host_copy(self, t):
        self.add("host_copy", self.current(DEVICE).name)
        return t.clone()


class Ops:
    """A rank's IssueOps against the fake: logs each issue on the stream current at the time."""

    def __init__(self, fake: "Fake"):
        self.fake = fake

    def counts(self, c):
        self.fake.add("counts_started", c)
        return torch.zeros(2, 3, dtype=torch.int64), self.fake.Work(self.fake, c)

    def routed(self, c, counts):
        self.fake.add("routed", c)

    def transfer(self, t):
        self.fake.add("launch", t, self.fake.current(DEVICE).name)
        return [self.fake.Work(self.fake, t)]


def _run(fake: Fake, name: str, tasks, L: int):
    ex = IssueExecutor(L, None, device=DEVICE, api=fake.api)
    ex.run(tasks, sequence_of(name, tasks), lambda t: fake.add("compute", t, fake.current(DEVICE).name), Ops(fake))
    return ex


@pytest.mark.parametrize("lag", [0, 40])
@pytest.mark.parametrize("name, tasks", CASES, ids=[c[0] for c in CASES])
def test_single_issuer_orders_the_device_without_host_syncs(name, tasks, lag):
    """`lag`: polls before a counts copy is done; the issue order must not depend on it (two ranks
    whose counts arrive at different times still issue alike)."""
    fake = Fake(lag)
    L = num_layers(tasks)
    ex = _run(fake, name, tasks, L)
    log = fake.log
    main = threading.current_thread().name
    assert all(it[-1] == main for it in log), "something ran off the issuing thread"
    assert not [it for it in log if it[0] == "HOST_SYNC"]
    rec = {it[1]: (i, it[2]) for i, it in enumerate(log) if it[0] == "record"}
    side = {name for name in fake.side}
    assert len(side) == 3  # dispatch, combine, counts

    computes = [it[1] for it in log if it[0] == "compute"]
    assert computes == [t for t in tasks if not t.is_comm]  # list order, on the compute stream
    assert all(it[2] == "compute" for it in log if it[0] == "compute")
    at = {("compute", it[1]): i for i, it in enumerate(log) if it[0] == "compute"}
    launched = {it[1]: (i, it[2]) for i, it in enumerate(log) if it[0] == "launch"}
    started = {it[1]: i for i, it in enumerate(log) if it[0] == "counts_started"}

    lanes: dict[str, str] = {}
    done: dict = {}
    for k, t in enumerate(tasks):
        if not t.is_comm:
            continue
        i, s = launched[t]
        assert s in side and lanes.setdefault(t.stream, s) == s, (t, s)
        # The producer: the last wait of its side stream before it was issued, on an event
        # recorded on the compute stream after the compute before t in the list and before the
        # compute after it.
        w = [j for j in range(i) if log[j][0] == "wait" and log[j][1] == s][-1]
        i_rec, on = rec[log[w][2]]
        assert on == "compute", t
        before = [u for u in tasks[:k] if not u.is_comm]
        after = [u for u in tasks[k + 1:] if not u.is_comm]
        if before:
            assert at[("compute", before[-1])] < i_rec, t
        if after:
            assert i_rec < at[("compute", after[0])], t
        # The side stream waits the collective (device-side), then records the done event.
        assert log[i + 1][:3] == ("work_wait", s, t), log[i + 1]
        assert log[i + 2][0] == "record" and log[i + 2][2] == s, log[i + 2]
        done[t] = log[i + 2][1]
    assert lanes["dispatch"] != lanes["combine"]
    for lane in ("dispatch", "combine"):
        want = [t for t in tasks if t.is_comm and t.stream == lane]
        assert sorted(want, key=lambda t: launched[t][0]) == want, f"{lane} not FIFO"
        assert ex.executed_streams[lane] == want

    # Consumers wait the done event (recorded on the transfer's side stream after it) on the
    # compute stream right before they are enqueued.
    for t in computes:
        need = inputs(t, L)
        if need is None:
            continue
        i_c = at[("compute", t)]
        w = [j for j in range(i_c) if log[j][0] == "wait" and log[j][1] == "compute"]
        assert w, t
        ev = log[w[-1]][2]
        i_rec, on = rec[ev]
        assert ev == done[need] and launched[need][0] < i_rec < i_c, (t, need)

    # Counts: each issued on the counts stream (after a producer wait, then the collective, then
    # the copy to the host), and its payload issued only after the copy's event said done: never
    # before `lag` polls.
    counts_stream = (side - set(lanes.values())).pop()
    routed = {it[1]: i for i, it in enumerate(log) if it[0] == "routed"}
    for c, i in started.items():
        assert i < routed[c] < launched[next(t for t in tasks if t.kind == "D_F" and (t.layer, t.microbatch)
                                             == (c.layer, c.microbatch))][0]
    copies = [i for i, it in enumerate(log) if it[0] == "host_copy"]
    assert len(copies) == len(started) and all(log[i][1] == counts_stream for i in copies)
    assert (ex.polls > 0) == (lag > 0)  # the host waited only by polling, and only while counts travelled
    # Every collective in the sequence's order, compute tasks at their places among them.
    seq = sequence_of(name, tasks)
    assert ex.issued_order == [it for it in seq if isinstance(it, Counts) or it.is_comm]
    issued = [it[1] for it in log if it[0] in ("counts_started", "launch", "compute")]
    assert issued == seq

    # The end: the compute stream waits every transfer's done event.
    last = max(max(at.values()), max(i for i, _ in launched.values()))
    tail = {it[2] for it in log[last + 1:] if it[0] == "wait" and it[1] == "compute"}
    assert tail == set(done.values())


def test_issuer_choice_and_refusals():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    timed = EmulatedTiming(lambda t: 0.0)
    assert isinstance(make_executor(2, "auto", None, gpu, "nccl"), IssueExecutor)
    assert isinstance(make_executor(2, "auto", None, gpu, "gloo"), TaskExecutor)  # gloo's wait blocks the host
    assert isinstance(make_executor(2, "auto", None, cpu, "gloo"), TaskExecutor)
    assert isinstance(make_executor(2, "single", None, cpu, "gloo"), IssueExecutor)
    assert isinstance(make_executor(2, "threads", None, gpu, "gloo"), TaskExecutor)
    # NCCL: several threads must not issue to communicators of one device at once (item 3)
    with pytest.raises(ValueError, match="threads on NCCL: .* NCCL does not allow several threads"):
        make_executor(2, "threads", None, gpu, "nccl")
    with pytest.raises(ValueError, match="emulated cluster on NCCL ranks"):
        make_executor(2, "auto", None, gpu, "nccl", timed)
    with pytest.raises(ValueError, match="cannot emulate a cluster"):
        make_executor(2, "single", None, cpu, "gloo", timed)
    with pytest.raises(ValueError, match="single on a CUDA rank needs NCCL, not gloo; pass threads"):
        make_executor(2, "single", None, gpu, "gloo")
    with pytest.raises(ValueError, match="--hetero-zebra-issuer 'one' is unknown"):
        HeteroRunConfig(zebra_issuer="one")
    with pytest.raises(ConfigError, match="--hetero-zebra-issuer single cannot emulate"):
        check_issuer("single", emulated=True)
    check_issuer("single", emulated=False)
    check_issuer("auto", emulated=True)
