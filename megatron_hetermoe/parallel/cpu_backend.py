"""Run megatron-core 0.16.1 .. 0.19.x on CPU over gloo.

megatron-core assumes CUDA in a handful of places. Each assumption is bridged by one named
patch below; `apply()` installs the ones the installed megatron-core needs (`patches_for`,
`NEEDED_IN`) once and is a no-op when CUDA is available, so the same code runs unchanged on GPU
ranks; `apply(force=True)` makes a CPU rank even on a GPU host (the fork launcher's children).
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
import logging
import os
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

_applied: set[str] = set()


# --- 1. CUDA streams and events ---------------------------------------------------------
class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU ops are synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "_CpuEvent":
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Stands in for torch.cuda.Event; elapsed_time is not meaningful on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def patch_cuda_streams() -> None:
    """Fake torch.cuda.Stream/current_stream/stream/Event/synchronize.

    Why: the alltoall dispatcher copies split sizes on a side stream
    (`torch.cuda.Stream()`), DDP creates a communication stream, and both record events.
    """
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    torch.cuda.default_stream = lambda device=None: _CPU_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.record_stream = lambda self, stream: None


# --- 2. current device ------------------------------------------------------------------
def patch_current_device() -> None:
    """Make torch.cuda.current_device() name the CPU.

    Why: megatron allocates its global memory buffer, router buffers, all_to_all outputs and
    p2p shape tensors with `device=torch.cuda.current_device()`.
    """
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0


# --- 3. RNG -----------------------------------------------------------------------------
def patch_rng() -> None:
    """Give megatron's CUDA RNG tracker the CPU generator.

    Why: `model_parallel_cuda_manual_seed` and `CudaRNGStatesTracker.add/fork` call
    torch.cuda.manual_seed / get_rng_state / set_rng_state, which fail without CUDA. Forks
    (tensor-parallel and expert-parallel init regions) keep their own CPU generator states so
    a forked region does not disturb the default stream of random numbers, as on GPU.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    # On CPU the "CUDA" generator is the CPU one, so the tracker's check that a fork left the
    # CPU state alone always fires; it carries no information here.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda rec: "CPU RNG state changed" not in rec.getMessage()
    )
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the generator directly.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.initial_seed = lambda: torch.initial_seed()


# --- 5. split sizes ---------------------------------------------------------------------
def patch_split_sizes_to_cpu() -> None:
    """Make `maybe_move_tensor_to_cpu` convert CPU tensors too (to numpy when asked).

    Why: it only converts when `tensor.is_cuda`; on CPU the alltoall dispatcher then hands
    split-size *tensors* to all_to_all_single, which wants Python lists (numpy's tolist()).
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- 6. device="cuda" sites -------------------------------------------------------------
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
    clip_grads and MoE logging allocate with a literal `device="cuda"`. Also makes
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


# --- 7. torch norms under sequence parallelism ----------------------------------------------
def patch_torch_norm_sequence_parallel() -> None:
    """Let megatron-core's WrappedTorchNorm (the local spec's LayerNorm/RMSNorm without apex or
    TE) build under sequence parallelism, marking its parameters `sequence_parallel` as
    megatron-core's FusedLayerNorm and TE's norms do.

    Why: WrappedTorchNorm asserts "sequence parallel not supported by torch LayerNorm", so TP > 1
    with --sequence-parallel (which Megatron requires for MoE) cannot build on CPU. A norm is
    pointwise over the hidden dimension, so it is correct on a sequence shard; its gradient is
    then partial per TP rank, and finalize_model_grads sums it over the TP group for parameters
    marked `sequence_parallel` (as it does for the fused norms).
    """
    import copy

    from megatron.core.transformer import torch_norm

    orig = torch_norm.WrappedTorchNorm.__new__
    if getattr(orig, "_hetermoe_sp", False):
        return

    def __new__(cls, config, *args, **kwargs):
        sp = bool(config.sequence_parallel)
        if sp:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = orig(cls, config, *args, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", sp)
        return norm

    __new__._hetermoe_sp = True
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


# --- 8. separate key and value head widths in the local attention core ---------------------
def patch_core_attention_kv_channels() -> None:
    """Let megatron-core's DotProductAttention (the local spec's attention core) take `k_channels`
    and `v_channels`, the per-head widths of queries/keys and of values, as transformer-engine's
    core takes them. Without the two keywords it is megatron-core's class unchanged.

    Why: multi-latent attention builds its core with k_channels = qk_head_dim +
    qk_pos_emb_head_dim and v_channels = v_head_dim (every release 0.16.1 .. 0.19 and main), which
    only TEDotProductAttention takes: "DotProductAttention.__init__() got an unexpected keyword
    argument 'k_channels'", so MLA cannot build on the local spec (every CPU rank). The core's
    forward takes every width from its inputs but its output's, hidden_size_per_partition
    (kv_channels x heads / TP), which v_channels sets here (v_channels x heads / TP). Scores
    are scaled by the softmax_scale MLA passes (yarn's mscale^2 / sqrt(q head dim)); without one,
    by 1 / sqrt(k_channels), as transformer-engine's core (then / layer number where
    apply_query_key_layer_scaling, in megatron-core's own __init__).
    """
    import functools
    import math

    from megatron.core.transformer import dot_product_attention

    cls = dot_product_attention.DotProductAttention
    orig = cls.__init__
    if getattr(orig, "_hetermoe_kv", False):
        return

    @functools.wraps(orig)
    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        if k_channels is None and v_channels is None:
            return orig(self, *args, **kwargs)
        # softmax_scale is the 6th parameter (config, layer_number, attn_mask_type,
        # attention_type, attention_dropout, softmax_scale, ...) in every release
        if len(args) < 6 and kwargs.get("softmax_scale") is None and k_channels is not None:
            kwargs["softmax_scale"] = 1.0 / math.sqrt(k_channels)
        orig(self, *args, **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    __init__._hetermoe_kv = True
    cls.__init__ = __init__


# --- 9. MLA's transformer-engine check without transformer-engine ---------------------------
def patch_mla_have_te() -> None:
    """Make multi_latent_attention.HAVE_TE say whether transformer-engine is there
    (megatron.core.extensions.transformer_engine.HAVE_TE), as megatron-core 0.17+ read it.

    Why: 0.16.1's multi_latent_attention sets HAVE_TE when it can import the extension's TELinear,
    which imports without transformer-engine too (as a MagicMock stand-in), so every MLA layer's
    __init__ calls isinstance(linear_proj, TELinear) and fails: "isinstance() arg 2 must be a
    type, a tuple of types, or a union". With HAVE_TE False that fp8/fp4 branch is skipped, as
    on a GPU without transformer-engine it should be.
    """
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = transformer_engine.HAVE_TE


PATCHES: dict[str, Callable[[], None]] = {
    "cuda_streams": patch_cuda_streams,
    "current_device": patch_current_device,
    "rng": patch_rng,
    "split_sizes_to_cpu": patch_split_sizes_to_cpu,
    "cuda_device_literals": patch_cuda_device_literals,
    "torch_norm_sequence_parallel": patch_torch_norm_sequence_parallel,
    "core_attention_kv_channels": patch_core_attention_kv_channels,
    "mla_have_te": patch_mla_have_te,
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
    "mla_have_te": ((0, 16, 1), (0, 17, 0)),  # 0.17.0 imports HAVE_TE from the extension
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
        # This process is a CPU rank: a GPU host's answer (cached by torch from before a fork)
        # must not steer code onto CUDA.
        torch.cuda.is_available = lambda: False
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
