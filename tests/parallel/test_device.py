"""parallel/device.py on CPU: the NCCL branch of init_distributed with torch.cuda and
init_process_group faked (the GPU is pinned before the group exists), the per-backend
timeouts, and the fork launcher never asking the parent about CUDA."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_hetermoe.parallel import device as dev
from megatron_hetermoe.parallel.launcher import collective_timeout, launch


@pytest.fixture
def fake_gpus(monkeypatch):
    """4 visible GPUs; records set_device and init_process_group calls in order."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    return calls


def test_nccl_pins_local_rank_gpu_before_the_group(fake_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "6")
    got = dev.init_distributed()
    assert got == torch.device("cuda", 2)  # 6 mod 4 visible GPUs
    assert fake_gpus[0] == ("set_device", torch.device("cuda", 2))
    kind, backend, kw = fake_gpus[1]
    assert (kind, backend) == ("init", "nccl")
    assert kw["timeout"] == datetime.timedelta(minutes=10)
    assert kw.get("device_id", torch.device("cuda", 2)) == torch.device("cuda", 2)


def test_nccl_refuses_to_guess_the_gpu(fake_gpus, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set and 4 GPUs are visible"):
        dev.init_distributed()
    assert fake_gpus == []
    with pytest.raises(ValueError, match="backend='mpi'"):
        dev.init_distributed("mpi")


def test_group_timeouts_and_devices():
    assert dev.group_timeout("nccl") == datetime.timedelta(minutes=10)
    assert dev.group_timeout("cpu:gloo,cuda:nccl") == datetime.timedelta(minutes=10)
    assert dev.group_timeout("gloo") == collective_timeout()
    assert dev.rank_device() == torch.device("cpu")  # no process group here
    assert dev.rank_device(cuda=False) == torch.device("cpu")

    def f():
        return 1

    assert dev.bind_device(f, torch.device("cpu")) is f
    assert dev.bind_device(f) is f  # CUDA not in use


def _cuda_view(rank: int, world: int):
    import os

    return torch.cuda.is_available(), os.environ["CUDA_VISIBLE_DEVICES"], dev.rank_device()


def test_fork_launcher_never_asks_the_parent_about_cuda(monkeypatch):
    # As on a GPU host with CUDA torch: the parent must not query CUDA (that poisons fork), and
    # each rank is a CPU rank whatever the parent's torch would answer.
    def poisoned():
        raise AssertionError("torch.cuda.is_available() called in the launcher's parent")

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    assert launch(_cuda_view, 2, timeout_s=60) == [(False, "", torch.device("cpu"))] * 2


def test_gpu_memory_report_is_absent_on_cpu(monkeypatch):
    def no(*a, **k):
        raise AssertionError("a CPU rank touched CUDA or a collective for the GPU memory report")

    for name in ("reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, no)
    monkeypatch.setattr(dist, "all_gather_object", no)
    dev.reset_peak_memory(torch.device("cpu"))
    assert dev.peak_gpu_mib("attention", torch.device("cpu"), None) is None  # absent, not zeros


def test_gpu_memory_report_on_cuda_ranks(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("max", d)) or 3 * 2**20)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def gather(out, obj, group=None):
        calls.append(("gather", group))
        out[:] = [obj, ("expert", 5.0)]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    cuda = torch.device("cuda", 1)
    dev.reset_peak_memory(cuda)
    assert dev.peak_gpu_mib("attention", cuda, "G") == [("attention", 3.0), ("expert", 5.0)]
    assert calls == [("reset", cuda), ("max", cuda), ("gather", "G")]
