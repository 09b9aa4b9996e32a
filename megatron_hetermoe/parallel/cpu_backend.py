"""Run megatron-core 0.16.1 .. 0.19.x on CPU over gloo.

megatron-core assumes CUDA in a handful of places. Each assumption is bridged by one named
patch, its body in the shim named for what it patches (shims/); `apply()` installs the ones
the installed megatron-core needs (`patches_for`, `NEEDED_IN`) once and is a no-op when CUDA is
available, so the same code runs unchanged on GPU ranks; `apply(force=True)` makes a CPU rank
even on a GPU host (the fork launcher's children).
Three patches are not about CPUs but about megatron-core's local spec on any device
(LOCAL_SPEC_PATCHES: torch norms under sequence parallelism, multi-latent attention's core and its
transformer-engine check); `apply_for_spec` installs them on CUDA ranks that build that spec
(`torch_norm_patch_applies` decides).
Each patch has a canary test (tests/parallel/test_cpu_backend.py) that shows the original failure
with the patch off, so an upstream fix is noticed; a patch that a release no longer needs has a
canary showing the fix (compat.py records which release changed what).
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from megatron_hetermoe.shims import (
    dot_product_attention,
    moe_utils,
    multi_latent_attention,
    tensor_parallel_random,
    torch_cuda,
    torch_norm,
)

_applied: set[str] = set()


# --- RNG -------------------------------------------------------------------------------
def patch_rng() -> None:
    """torch.cuda's RNG and megatron's CUDA RNG tracker on the CPU generator (both halves)."""
    torch_cuda.rng_on_cpu()
    tensor_parallel_random.set_rng_state_on_cpu()


# --- device="cuda" sites ---------------------------------------------------------------
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Maps `device="cuda"` (and `.cuda()`) to the CPU for every torch call.

    Why: schedules (total_num_tokens), grad buffers, the optimizer (found_inf, grad scaler),
    clip_grads and MoE logging allocate with a literal `device="cuda"`; `pin_memory=True` (the
    rotary embedding's CP slice) is dropped, as there is no pinned allocator without a GPU. Also makes
    `Tensor.type()` report `torch.cuda.*` names for the optimizer's dtype checks.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # e.g. rope_utils' CP index tensor: no pinned allocator without a GPU
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) and i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


_MODE: CudaToCpuMode | None = None


def patch_cuda_device_literals() -> None:
    """Enter CudaToCpuMode for the life of the process (it survives fork)."""
    global _MODE
    _MODE = CudaToCpuMode()
    _MODE.__enter__()


def device_scope():
    """CudaToCpuMode for code that autograd runs during backward (activation recomputation):
    the engine runs backward with an empty TorchFunctionMode stack, so the process-wide mode
    does not reach it. A no-op when the patch is not applied (CUDA present)."""
    if "cuda_device_literals" in _applied:
        return CudaToCpuMode()
    return contextlib.nullcontext()


# Each patch's body is in the shim named for what it patches (shims/).
PATCHES: dict[str, Callable[[], None]] = {
    "cuda_streams": torch_cuda.stand_in_streams,
    "current_device": torch_cuda.current_device_is_cpu,
    "rng": patch_rng,
    "split_sizes_to_cpu": moe_utils.split_sizes_to_cpu,
    "cuda_device_literals": patch_cuda_device_literals,
    "torch_norm_sequence_parallel": torch_norm.sequence_parallel,
    "core_attention_kv_channels": dot_product_attention.kv_channels,
    "mla_have_te": multi_latent_attention.have_te_from_the_extension,
}


# The megatron-core releases each patch is needed in: [first, end). Seen by the canaries on
# 0.16.1 and 0.19.2, and from the source of the tags in between (compat.py's docstring).
_ALWAYS = ((0, 16, 1), None)
NEEDED_IN: dict[str, tuple[tuple[int, int, int], tuple[int, int, int] | None]] = {
    "cuda_streams": _ALWAYS,
    "current_device": _ALWAYS,
    "rng": _ALWAYS,
    "split_sizes_to_cpu": _ALWAYS,
    "cuda_device_literals": _ALWAYS,
    "torch_norm_sequence_parallel": _ALWAYS,
    "core_attention_kv_channels": _ALWAYS,  # read in every tag 0.16.1 .. 0.19.0 and main d98e8a6
    "mla_have_te": multi_latent_attention.RELEASES,
}


def patches_for(version: tuple[int, int, int] | None = None) -> tuple[str, ...]:
    """The patches megatron-core `version` (default: the installed one) needs on CPU, in order."""
    if version is None:
        from megatron_hetermoe.compat import mcore_version

        version = mcore_version()
    v = tuple(version)
    return tuple(n for n in PATCHES if NEEDED_IN[n][0] <= v and (NEEDED_IN[n][1] is None or v < NEEDED_IN[n][1]))


def apply(skip: tuple[str, ...] = (), force: bool = False) -> list[str]:
    """Install every patch the installed megatron-core needs (patches_for) and `skip` does not
    name, once per process. No-op when CUDA is available, unless `force`: then the patches go
    in without querying CUDA (the query poisons fork) and torch.cuda.is_available() answers
    False from then on (a CPU rank on a GPU host).

    Returns the names of the patches installed by this call. $HETERMOE_CPU_PATCHES_SKIP (comma
    separated names) adds to `skip`; the canary tests use it to show each patch is still needed.
    """
    if not force and torch.cuda.is_available():
        return []
    if force:
        torch_cuda.answer_no_cuda()
    skip = tuple(skip) + tuple(s for s in os.environ.get("HETERMOE_CPU_PATCHES_SKIP", "").split(",") if s)
    unknown = set(skip) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown cpu_backend patch(es) {sorted(unknown)}; known: {sorted(PATCHES)}")
    needed = patches_for()
    done = []
    for name, fn in PATCHES.items():
        if name in skip or name in _applied or name not in needed:
            continue
        fn()
        _applied.add(name)
        done.append(name)
    return done


# --- the local spec's patches on every device -----------------------------------------------
_NORM_PATCH = "torch_norm_sequence_parallel"
# What megatron-core's local spec needs on any device, not only on CPU ranks: its torch norms
# under sequence parallelism, and multi-latent attention's core and transformer-engine check.
LOCAL_SPEC_PATCHES = (_NORM_PATCH, "core_attention_kv_channels", "mla_have_te")


def torch_norm_patch_applies(device, transformer_impl: str) -> bool:
    """Whether a rank on `device` whose layers come from Megatron's `transformer_impl` spec needs
    torch_norm_sequence_parallel: every CPU rank (apply() installs it with the other CPU patches),
    and a CUDA rank on megatron-core's local spec, whose RMSNorm is torch's WrappedTorchNorm
    whatever imports (its LayerNorm too without apex): that norm asserts sequence parallelism off,
    so TP > 1 without transformer-engine could not build on GPUs either. A transformer_engine
    rank builds TE's norms, which take sequence parallelism themselves. The same ranks need the
    other LOCAL_SPEC_PATCHES: the local spec's MLA core is DotProductAttention (TE's takes k/v
    widths itself)."""
    return torch.device(device).type != "cuda" or transformer_impl != "transformer_engine"


def apply_for_spec(device, transformer_impl: str) -> bool:
    """Install LOCAL_SPEC_PATCHES where torch_norm_patch_applies, CUDA ranks included (where
    apply() installs nothing), each unless $HETERMOE_CPU_PATCHES_SKIP names it or the installed
    megatron-core does not need it (patches_for). Returns whether torch_norm_sequence_parallel is
    in place."""
    skip = os.environ.get("HETERMOE_CPU_PATCHES_SKIP", "").split(",")
    if torch_norm_patch_applies(device, transformer_impl):
        needed = patches_for()
        for name in LOCAL_SPEC_PATCHES:
            if name not in skip and name in needed and name not in _applied:
                PATCHES[name]()
                _applied.add(name)
    return _NORM_PATCH in _applied


def preload() -> None:
    """Import the megatron-core modules the patches change, without patching or querying CUDA:
    the fork launcher's parent on a CUDA build of torch, so forked CPU ranks need not import
    them (each rank then patches itself with apply(force=True))."""
    import megatron.core.tensor_parallel.random  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
    import megatron.core.transformer.dot_product_attention  # noqa: F401
    import megatron.core.transformer.torch_norm  # noqa: F401


def applied() -> frozenset[str]:
    return frozenset(_applied)
