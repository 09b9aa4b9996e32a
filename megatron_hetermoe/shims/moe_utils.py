"""megatron-core's MoE utilities (megatron.core.transformer.moe.moe_utils)."""
from __future__ import annotations

import torch


def split_sizes_to_cpu() -> None:
    """Make `maybe_move_tensor_to_cpu` convert CPU tensors too (to numpy when asked), in
    moe_utils and where token_dispatcher imported it.

    Why: it only converts when `tensor.is_cuda`; on CPU the alltoall dispatcher then hands
    split-size *tensors* to all_to_all_single, which wants Python lists (numpy's tolist()).
    Every release 0.16.1 .. 0.19 (a CPU rank's patch: parallel/cpu_backend.py).
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


def bind_missing_te_general_gemm() -> None:
    """megatron-core 0.13-0.16 import transformer-engine's general_gemm inside a try block and
    test `te_general_gemm is not None` in the router's gating, but never bind the name when the
    import fails: without transformer-engine the router raises NameError, on CPU and GPU alike
    (seen on an H200 with 0.16.1). Bind it to None, as 0.17 does. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
