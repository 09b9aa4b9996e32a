"""Canaries: each CPU patch is still needed. With one patch left out, the step fails exactly
the way megatron-core 0.16.1 fails on CPU; when upstream fixes one, its canary goes red."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hetermoe import cpu_backend

HERE = Path(__file__).parent

KNOWN_FAILURES = {
    "cuda_streams": "torch.cuda.Stream requires CUDA support",
    "current_device": "Torch not compiled with CUDA enabled",
    "rng": "Torch not compiled with CUDA enabled",
    "te_general_gemm": "name 'te_general_gemm' is not defined",
    "split_sizes_to_cpu": "all_to_all_single(): incompatible function arguments",
    "cuda_device_literals": "Torch not compiled with CUDA enabled",
}


def _step(skip: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HETERMOE_CPU_PATCHES_SKIP=skip, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-W", "ignore", str(HERE / "canary_step.py")], env=env,
                          capture_output=True, text=True, timeout=180)


def test_every_patch_has_a_canary():
    assert set(KNOWN_FAILURES) == set(cpu_backend.PATCHES)


@pytest.mark.slow
def test_all_patches_train_a_step():
    r = _step("")
    assert "CANARY-OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("patch", sorted(KNOWN_FAILURES))
def test_patch_still_needed(patch):
    r = _step(patch)
    assert "CANARY-OK" not in r.stdout, f"{patch}: megatron-core now works without it; drop the patch"
    assert KNOWN_FAILURES[patch] in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def test_apply_is_idempotent_and_checks_names():
    assert cpu_backend.apply() == []  # conftest applied everything already
    assert cpu_backend.applied() == frozenset(cpu_backend.PATCHES)
    with pytest.raises(ValueError, match="unknown cpu_backend patch"):
        cpu_backend.apply(skip=("no_such_patch",))


def test_noop_when_cuda_is_available(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_backend.apply(skip=("no_such_patch",)) == []
