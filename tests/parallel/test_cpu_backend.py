"""Canaries: each CPU patch the installed megatron-core needs is still needed. With one patch
left out, the step fails exactly the way megatron-core fails on CPU; when upstream fixes one,
its canary goes red. A patch a release no longer needs has a canary showing the fix."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_hetermoe import compat
from megatron_hetermoe.parallel import cpu_backend

HERE = Path(__file__).resolve().parents[1]  # tests/ (canary_step.py)
VERSION = compat.mcore_version()
NEEDED = cpu_backend.patches_for()

# How a step fails without each patch. A CPU build of torch says so at the first CUDA call; a
# CUDA build on a machine without a GPU (what PyPI gives for megatron-core 0.17+ on Python 3.12)
# fails in the driver, or, in a forked rank, refuses to initialize CUDA. The second column is
# the CUDA build's message and the megatron-core / torch frames that must be on the way there.
_NO_DRIVER = ("CUDA driver version is insufficient", "Found no NVIDIA driver",
              "Cannot re-initialize CUDA in forked subprocess")
KNOWN_FAILURES = {
    "cuda_streams": ("torch.cuda.Stream requires CUDA support", (_NO_DRIVER, "torch/cuda/streams.py")),
    "current_device": ("Torch not compiled with CUDA enabled", (_NO_DRIVER, "current_device")),
    "rng": ("Torch not compiled with CUDA enabled", (_NO_DRIVER, "tensor_parallel/random.py")),
    "split_sizes_to_cpu": ("all_to_all_single(): incompatible function arguments",
                           (("all_to_all_single(): incompatible function arguments",), "")),
    "cuda_device_literals": ("Torch not compiled with CUDA enabled", (_NO_DRIVER, "megatron/core/optimizer")),
    "torch_norm_sequence_parallel": ("sequence parallel not supported by torch LayerNorm",
                                     (("sequence parallel not supported by torch LayerNorm",), "torch_norm.py")),
    "core_attention_kv_channels": ("got an unexpected keyword argument 'k_channels'",
                                   (("got an unexpected keyword argument 'k_channels'",), "multi_latent_attention.py")),
    "mla_have_te": ("isinstance() arg 2 must be a type",
                    (("isinstance() arg 2 must be a type",), "multi_latent_attention.py")),
}
# The canary step a patch shows its failure in (canary_step.py's argument): TP=2 + SP, EP=2 on 4 ranks.
CANARY_ARGS = {"torch_norm_sequence_parallel": ["tp2"]}
# Patches whose canary step is another script: multi-latent attention's (a DeepSeek-shaped GPTModel).
MLA_STEP = Path(__file__).with_name("test_cpu_mla.py")
CANARY_SCRIPTS = {"core_attention_kv_channels": MLA_STEP, "mla_have_te": MLA_STEP}


def _mla_have_te_fixed() -> bool:
    """0.17+: multi_latent_attention reads HAVE_TE from the transformer-engine extension."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention.HAVE_TE is transformer_engine.HAVE_TE


# For a patch the installed release does not need: the upstream fix, seen without the patch.
UPSTREAM_FIXES: dict = {"mla_have_te": _mla_have_te_fixed}


def _step(skip: str, args: list[str] = (), script: Path = HERE / "canary_step.py") -> subprocess.CompletedProcess:
    env = dict(os.environ, HETERMOE_CPU_PATCHES_SKIP=skip, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-W", "ignore", str(script), *args], env=env,
                          capture_output=True, text=True, timeout=180)


def _failed_as_known(patch: str, out: str) -> bool:
    cpu_msg, (cuda_msgs, site) = KNOWN_FAILURES[patch]
    if torch.version.cuda is None:  # a CPU build of torch
        return cpu_msg in out
    return any(m in out for m in cuda_msgs) and site in out


def test_every_patch_has_a_canary():
    assert set(KNOWN_FAILURES) == set(cpu_backend.PATCHES) == set(cpu_backend.NEEDED_IN)
    assert set(cpu_backend.PATCHES) - set(NEEDED) <= set(UPSTREAM_FIXES)


def test_patches_chosen_per_version():
    every = tuple(cpu_backend.PATCHES)
    assert cpu_backend.patches_for((0, 16, 1)) == every
    for v in ((0, 17, 0), (0, 18, 2), (0, 19, 2)):  # 0.17.0 fixed MLA's HAVE_TE
        assert cpu_backend.patches_for(v) == tuple(p for p in every if p != "mla_have_te")


@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["tp2"]], ids=["ep2", "tp2-sp-ep2"])
def test_all_patches_train_a_step(args):
    r = _step("", args)
    assert "CANARY-OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_all_patches_run_the_mla_step():
    r = _step("", script=MLA_STEP)
    assert "CANARY-OK" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("patch", sorted(KNOWN_FAILURES))
def test_patch_still_needed(patch):
    if patch not in NEEDED:
        pytest.skip(f"{patch} is not applied on megatron-core {'.'.join(map(str, VERSION))}; "
                    f"test_patch_not_needed checks the upstream fix")
    r = _step(patch, CANARY_ARGS.get(patch, []), CANARY_SCRIPTS.get(patch, HERE / "canary_step.py"))
    assert "CANARY-OK" not in r.stdout, f"{patch}: megatron-core now works without it; drop the patch"
    assert _failed_as_known(patch, r.stdout + r.stderr), (r.stdout + r.stderr)[-3000:]


@pytest.mark.parametrize("patch", sorted(UPSTREAM_FIXES))
def test_patch_not_needed(patch):
    if patch in NEEDED:
        pytest.skip(f"{patch} is needed on megatron-core {'.'.join(map(str, VERSION))}; "
                    f"test_patch_still_needed checks it")
    assert UPSTREAM_FIXES[patch](), f"{patch}: megatron-core {VERSION} no longer has the fix; re-enable the patch"


def test_apply_is_idempotent_and_checks_names():
    assert cpu_backend.apply() == []  # conftest applied everything already
    assert cpu_backend.applied() == frozenset(NEEDED)
    with pytest.raises(ValueError, match="unknown cpu_backend patch"):
        cpu_backend.apply(skip=("no_such_patch",))


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_backend.apply(skip=("no_such_patch",)) == []
