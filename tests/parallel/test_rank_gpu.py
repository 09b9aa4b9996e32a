"""A CUDA rank's start checks (issue 24 item 14), their logic on CPU: the installed torch has
kernels for the rank's GPU, and the GPU is the plan's type for the rank."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_hetermoe.parallel import device as dev
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.planner.profiles import load_profile

CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]  # torch 2.11 cu130's kind
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize("cap, arch, ok", [
    ((7, 0), CU130, False), ((7, 0), CU126, True), ((7, 5), CU130, True), ((8, 6), ["sm_80"], True),
    ((8, 9), ["sm_80", "sm_86"], True), ((8, 0), ["sm_86"], False), ((9, 0), ["sm_80"], False),
    ((9, 0), ["sm_80", "compute_80"], True), ((10, 0), CU126, False), ((12, 0), CU130, True),
    ((9, 0), ["sm_90a"], True), ((9, 1), ["sm_90a"], False),
])
def test_arch_coverage(cap, arch, ok):
    assert dev.arch_covered(cap, arch) is ok


def test_v100_on_a_cu130_torch_names_the_build_that_works():
    msg = dev.arch_error("Tesla V100-SXM2-16GB", (7, 0), CU130, "2.11.0+cu130", "13.0")
    assert "sm_70" in msg and "cu126" in msg and "whl/cu126" in msg and "no kernel image is available" in msg


@pytest.mark.parametrize("gpu_type, name, gib, ok", [
    ("V100-16GB", "Tesla V100-SXM2-16GB", 15.8, True), ("V100-32GB", "Tesla V100-SXM2-16GB", 15.8, False),
    ("V100-32GB", "Tesla V100-PCIE-32GB", 31.7, True), ("A40", "NVIDIA A40", 44.4, True),
    ("A40", "Tesla V100-SXM2-16GB", 15.8, False), ("H100", "NVIDIA H100 80GB HBM3", 79.1, True),
    ("L40S", "NVIDIA L40", 44.4, False), ("T4", "Tesla T4", 14.6, True), ("H200", "NVIDIA H200", 139.8, True),
    ("A100-80GB", "NVIDIA A100-SXM4-80GB", 79.2, True), ("A100-80GB", "NVIDIA A100-SXM4-40GB", 39.4, False),
])
def test_gpu_type_matching(gpu_type, name, gib, ok):
    assert dev.gpu_type_matches(load_profile(gpu_type), name, gib) is ok


def test_a_profiles_device_name_pattern_wins():
    prof = types.SimpleNamespace(name="my-lab-gpu", memory_gib=24.0, device_name=r"RTX A5000")
    assert dev.gpu_type_matches(prof, "NVIDIA RTX A5000", 23.7)
    assert not dev.gpu_type_matches(prof, "NVIDIA A40", 44.4)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering as a host whose GPU is `gpu` (set by the test)."""
    gpu = {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: gpu["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: gpu["cap"])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: gpu["arch"])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(total_memory=int(gpu["gib"] * 2**30)))
    return gpu


def _plan():
    plan = even_plan(2, 4, 1, 1)
    plan.gpu_types = ["A40", "V100-16GB"]  # rank 0 attention on an A40, rank 1 experts on a V100
    return plan


def test_attention_rank_on_a_v100_is_refused(fake_cuda):
    fake_cuda.update(name="Tesla V100-SXM2-16GB", cap=(7, 0), arch=CU126, gib=15.8)
    with pytest.raises(RuntimeError, match=r"rank 0 \(attention rank\) is on a Tesla V100-SXM2-16GB \(16 GiB\) but "
                                           r"the plan gives it a A40"):
        dev.check_rank_gpu(_plan(), 0, torch.device("cuda", 0))
    dev.check_rank_gpu(_plan(), 1, torch.device("cuda", 0))  # the expert rank is where the plan says


def test_expert_rank_on_a_torch_without_its_kernels_is_refused(fake_cuda):
    fake_cuda.update(name="Tesla V100-SXM2-16GB", cap=(7, 0), arch=CU130, gib=15.8)
    with pytest.raises(RuntimeError, match="rank 1: .*cu126"):
        dev.check_rank_gpu(_plan(), 1, torch.device("cuda", 0))


def test_cpu_ranks_are_not_checked():
    dev.check_rank_gpu(_plan(), 0, torch.device("cpu"))
