"""megatron-core's DotProductAttention (megatron.core.transformer.dot_product_attention): the
local spec's attention core."""
from __future__ import annotations


def kv_channels() -> None:
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
