"""megatron-core's WrappedTorchNorm (megatron.core.transformer.torch_norm): the local spec's norms."""
from __future__ import annotations


def sequence_parallel() -> None:
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
