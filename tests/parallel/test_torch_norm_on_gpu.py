"""TP > 1 on GPUs without transformer-engine (issue 43 item 4): megatron-core's local spec builds
torch's RMSNorm (WrappedTorchNorm), which asserts sequence parallelism off; the patch that lets it
build (cpu_backend's torch_norm_sequence_parallel) now goes in on CUDA ranks on that spec too, not
only with the CPU patches (apply() installs nothing where CUDA exists)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from megatron_hetermoe.parallel import cpu_backend


@pytest.mark.parametrize("device, impl, applies", [
    ("cuda", "local", True),  # no transformer-engine (or a pool too old for it): the local spec's torch norms
    ("cuda:1", "local", True),
    ("cuda", "transformer_engine", False),  # TE's norms take sequence parallelism themselves
    ("cpu", "local", True),
    ("cpu", "transformer_engine", True),  # CPU ranks: with the other CPU patches
])
def test_which_ranks_need_the_norm_patch(device, impl, applies):
    assert cpu_backend.torch_norm_patch_applies(device, impl) is applies


def test_apply_for_spec_installs_it_on_a_cuda_rank_on_the_local_spec(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_backend, "_applied", set())
    monkeypatch.setitem(cpu_backend.PATCHES, "torch_norm_sequence_parallel", lambda: calls.append(1))
    assert not cpu_backend.apply_for_spec("cuda", "transformer_engine") and calls == []
    assert cpu_backend.apply_for_spec("cuda", "local") and calls == [1]
    assert cpu_backend.apply_for_spec("cuda", "local") and calls == [1]  # once
    monkeypatch.setattr(cpu_backend, "_applied", set())
    monkeypatch.setenv("HETERMOE_CPU_PATCHES_SKIP", "torch_norm_sequence_parallel")  # the canaries' switch
    assert not cpu_backend.apply_for_spec("cuda", "local") and calls == [1]


# A fresh interpreter that looks like a GPU host to the CPU backend (torch.cuda.is_available() True,
# so apply() installs nothing), building the local spec's norms under TP 2 + sequence parallelism as
# the trainers do (models.builder.block_spec with the rank's device).
_GPU_HOST = textwrap.dedent("""
    import torch
    torch.cuda.is_available = lambda: True
    from megatron.core.transformer.spec_utils import build_module
    from megatron_hetermoe.config import ModelConfig, ParallelConfig
    from megatron_hetermoe.models import builder
    from megatron_hetermoe.parallel import cpu_backend

    assert cpu_backend.apply() == []
    model = ModelConfig.load("tiny")
    cfg = builder.transformer_config(model, ParallelConfig(tp=2, sequence_parallel=True))
    def norm(spec):
        return build_module(spec.layer_norm, config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon)
    try:
        norm(builder.block_spec(model, "local", cfg))  # no device: nothing installed
    except AssertionError as e:
        print("BEFORE", e)
    n = norm(builder.block_spec(model, "local", cfg, device="cuda"))
    print("AFTER", type(n).__name__, n.weight.sequence_parallel)
""")


def test_tp2_sequence_parallel_local_spec_builds_on_a_gpu_host():
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _GPU_HOST], capture_output=True, text=True, timeout=120)
    assert "BEFORE sequence parallel not supported by torch LayerNorm" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "AFTER RMSNorm True" in r.stdout, r.stdout + r.stderr[-3000:]
