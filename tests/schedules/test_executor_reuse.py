"""What a run's steps share and what each step pays for (issue 30 item 3): the threaded executor's
stream workers serve every step (keep_streams) and each step still reports only its own order; the
activation meter hooks nothing unless enabled; the single issuer on a CPU rank blocks until a
collective completes instead of sleep-polling."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fake_streams import CASES, num_layers, sequence_of

from megatron_hetermoe.schedules.executor import ActivationMeter, TaskExecutor
from megatron_hetermoe.schedules.issuer import IssueExecutor


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zebra-")}


@pytest.mark.parametrize("name, tasks", CASES, ids=[c[0] for c in CASES])
def test_kept_streams_serve_every_run_and_close_at_the_end(name, tasks):
    before = _workers()
    ex = TaskExecutor(num_layers(tasks), None, keep_streams=True)
    ran: list[list] = []
    for _ in range(3):
        order: list = []
        ex.run(tasks, lambda t: None, lambda t: (lambda: order.append(t)))
        assert ex.executed == [t for t in tasks if not t.is_comm]
        for lane in ("dispatch", "combine"):
            assert ex.executed_streams[lane] == [t for t in tasks if t.stream == lane]
        ran.append(ex.executed)
        if len(ran) == 1:
            workers = _workers() - before
            assert len(workers) == 2
        assert _workers() - before == workers  # the same two threads, not new ones per run
    assert ran[0] is not ran[1]  # a run's report is its own list, not the next run's
    ex.close()
    assert not any(t.is_alive() for t in workers)


def test_a_failed_run_drops_its_streams_and_the_next_run_makes_new_ones():
    tasks = CASES[0][1]
    ex = TaskExecutor(num_layers(tasks), None, keep_streams=True)
    ex.run(tasks, lambda t: None, lambda t: (lambda: None))
    first = dict(ex._streams)

    def boom():
        raise RuntimeError("collective failed")

    with pytest.raises(RuntimeError, match="collective failed"):
        ex.run(tasks, lambda t: None, lambda t: boom)
    assert ex._streams is None
    ex.run(tasks, lambda t: None, lambda t: (lambda: None))
    assert all(ex._streams[k] is not first[k] for k in first)
    ex.close()


def test_threaded_executor_without_keep_streams_leaves_no_thread():
    tasks = CASES[1][1]
    before = _workers()
    ex = TaskExecutor(num_layers(tasks), None)
    ex.run(tasks, lambda t: None, lambda t: (lambda: None))
    assert _workers() == before and ex._streams is None


def _saves(n: int) -> torch.Tensor:
    return torch.ones(n, requires_grad=True).exp().sum()  # exp saves its output: n floats


def test_meter_hooks_nothing_when_disabled_and_restarts_each_step():
    meter = ActivationMeter(enabled=False)
    with meter:
        loss = _saves(1000)
    assert meter.peak == 0 and not meter._finalizers
    del loss
    meter.enabled = True
    with meter:
        loss = _saves(1000)
    assert meter.peak == 1000 * 4
    del loss
    with meter:
        loss = _saves(10)
    assert meter.peak == 10 * 4  # from 0 again, not the previous step's peak
    del loss


class _Work:
    """A gloo-like Work whose future completes `after` seconds after issue, from another thread."""

    def __init__(self, after: float):
        self.fut = torch.futures.Future()
        self.done = threading.Event()
        threading.Timer(after, self._finish).start()

    def _finish(self):
        self.fut.set_result(None)  # gloo: the future first (its callbacks run here), then the Work
        time.sleep(0.002)
        self.done.set()

    def get_future(self):
        return self.fut

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> bool:
        self.fut.wait()
        return True


def test_single_issuer_on_a_cpu_rank_blocks_until_a_collective_completes(monkeypatch):
    # Every collective takes 20 ms: the issuer must wait, and it must do so without sleeping.
    from megatron_hetermoe.schedules import issuer

    sleeps = []
    monkeypatch.setattr(issuer, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=sleeps.append))
    name, tasks = CASES[1]  # an expert rank's list
    ex = IssueExecutor(num_layers(tasks), None)

    class Ops:
        def counts(self, c):
            return torch.zeros(2, 3, dtype=torch.int64), _Work(0.02)

        def routed(self, c, counts):
            pass

        def transfer(self, t):
            return [_Work(0.02)]

    t0 = time.perf_counter()
    ex.run(tasks, sequence_of(name, tasks), lambda t: None, Ops())
    took = time.perf_counter() - t0
    assert sleeps == []
    assert ex.executed == [t for t in tasks if not t.is_comm]
    # One wait per completion at most (each completion sets the event once), not a poll per
    # back-off period; and no wait ran out its timeout (a missed wake-up).
    n_works = sum(2 if t.kind == "D_F" else 1 for t in tasks if t.is_comm)
    assert 0 < ex.polls <= n_works, (ex.polls, n_works)
    assert took < len([t for t in tasks if t.is_comm]) * issuer.WAKE_TIMEOUT_S, took


def test_a_step_is_metered_only_when_its_report_reads_the_peak():
    from megatron_hetermoe.schedules.select import ExecutedSteps, _report, _step

    tasks = CASES[1][1]
    zr = SimpleNamespace(ex=TaskExecutor(num_layers(tasks), None, keep_streams=True))
    keep = []

    def step(executed):
        _step(zr, executed)
        zr.ex.run(tasks, lambda t: keep.append(_saves(100)), lambda t: (lambda: None))
        _report(zr, executed)
        keep.clear()

    log = ExecutedSteps(maxlen=1, meter=False)
    step(log)
    assert log[-1][2] is None and not zr.ex.meter._finalizers  # unmetered: no peak, no hook
    log.meter = True
    step(log)
    n = len([t for t in tasks if not t.is_comm])
    assert log[-1][2] == n * 100 * 4
    plain: list = []  # a plain list reads every step's peak
    step(plain)
    assert plain[-1][2] == n * 100 * 4
    step(None)
    assert not zr.ex.meter.enabled
    zr.ex.close()
