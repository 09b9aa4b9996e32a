"""Context parallelism (CP) for megatron-core's local attention core, on any device (CPU ranks too).

megatron-core's DotProductAttention asserts context_parallel_size == 1 (only transformer-engine's
core does CP, and transformer-engine does not install on CPU). ContextParallelAttention is that core
with CP, by Megatron's `--cp-comm-type` (TransformerConfig.cp_comm_type, per layer):
- `p2p` (Megatron-LM's default; None too, as transformer-engine reads it): a ring that passes keys and
  values around the CP group and merges partial softmaxes (models/ring_attention.py). Per rank: two
  key/value blocks and one s_local x s_local score block at a time.
- `all_gather`: each rank gathers the keys and values of its CP group, puts them in sequence order
  and attends from its own queries, masked at their true positions: S x b x (query groups / TP) x head
  dim of keys and of values all-gathered in forward and reduce-scattered in backward (megatron-core's
  sequence-parallel gather, given the CP group), and an s_local x S score matrix. Its outputs are
  DotProductAttention's on the full sequence bit for bit (the same sums in the same order).
- `a2a` and `a2a+p2p` (transformer-engine's head-scattering all-to-all): not built here; those layers
  all-gather, and the log says so once per process.

Sequence layout: Megatron's load-balanced split (megatron.core.utils.get_batch_on_this_cp_rank). The
sequence of S tokens is cut into 2 x cp chunks; CP rank r holds chunk r followed by chunk
2 x cp - 1 - r (S / cp tokens), so every rank has the same causal work.

Only causal self-attention (GPT's) is supported under CP; with a CP group of one rank the class is
DotProductAttention unchanged.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from megatron_hetermoe.models.ring_attention import RingConfig, local_positions, ring_attention


RING = "p2p"  # Megatron's --cp-comm-type for the ring (its default)
GATHER = "all_gather"
_TOLD: set[str] = set()  # the cp_comm_type values already named in the log


def comm_of(cp_comm_type: Optional[str]) -> str:
    """The communication this core does for a layer's cp_comm_type: the ring for p2p (and None, which
    transformer-engine reads as p2p), the all-gather for all_gather and (named in the log once per
    process) for transformer-engine's a2a and a2a+p2p, which are not built here."""
    if cp_comm_type in (None, RING):
        return RING
    if cp_comm_type == GATHER:
        return GATHER
    if cp_comm_type not in ("a2a", "a2a+p2p"):
        raise ValueError(f"cp_comm_type={cp_comm_type!r} (--cp-comm-type): Megatron's values are p2p, all_gather, "
                         f"a2a and a2a+p2p")
    if cp_comm_type not in _TOLD:
        _TOLD.add(cp_comm_type)
        logging.getLogger(__name__).warning(
            "cp_comm_type=%r (--cp-comm-type) is transformer-engine's all-to-all CP communication; megatron-core's "
            "local attention core has none, and ContextParallelAttention all-gathers keys and values for those "
            "layers instead (the same numbers). Pass --cp-comm-type p2p (a ring) or all_gather to choose, or use "
            "the transformer-engine spec.", cp_comm_type)
    return GATHER


class ContextParallelAttention(DotProductAttention):
    """DotProductAttention with context parallelism over `pg_collection.cp` (causal self-attention only):
    a ring for cp_comm_type p2p or None, an all-gather of keys and values for all_gather (and for a2a
    and a2a+p2p, named in the log once). Constructor and forward take DotProductAttention's arguments;
    extra keywords go to DotProductAttention (k_channels / v_channels where
    shims/dot_product_attention.kv_channels is installed)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        **kwargs: Any,
    ) -> None:
        if pg_collection is None and config.context_parallel_size > 1:
            # As the parent does for tp when no collection is given: megatron-core's globals.
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        cp_size = cp_group.size() if cp_group is not None else 1
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} in the config but the CP group "
                f"(pg_collection.cp) has {cp_size} rank(s); give a pg_collection whose cp group has "
                f"context_parallel_size ranks")

        if cp_size == 1:
            # Nothing to gather: DotProductAttention itself, arguments unchanged.
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                             softmax_scale, cp_comm_type, pg_collection, **kwargs)
            self.cp_group: Optional[torch.distributed.ProcessGroup] = cp_group
            self.cp_size: int = 1
            self.cp_comm: Optional[str] = None
            return

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"attn_mask_type={attn_mask_type} with context_parallel_size={cp_size}: "
                f"ContextParallelAttention does causal self-attention only; use AttnMaskType.causal, "
                f"or context_parallel_size=1")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError(
                f"window_size={config.window_size} (sliding-window attention) on layer {layer_number} with "
                f"context_parallel_size={cp_size}: not supported by ContextParallelAttention; drop "
                f"window_size or use context_parallel_size=1")

        self.cp_comm = comm_of(cp_comm_type)
        if self.cp_comm == RING and getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"softmax_type={config.softmax_type!r} with cp_comm_type={cp_comm_type!r} (the ring): the ring "
                f"merges vanilla softmaxes only; pass --cp-comm-type all_gather, or softmax_type 'vanilla'")
        # The parent asserts context_parallel_size == 1. copy.copy, not dataclasses.replace: a shallow
        # copy does not run TransformerConfig.__post_init__ again (its derivations and checks ran on
        # `config`), so the copy differs from `config` in that one field only.
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1
        # The parent's softmax gets AttnMaskType.arbitrary so that it applies the mask forward() builds:
        # with `causal` megatron-core's fused CUDA kernel (ScaledUpperTriangMaskedSoftmax: fp16/bf16
        # with masked_softmax_fusion) ignores the mask and asserts sq == sk, false here (s_local
        # queries, S keys); the torch path would use a given mask either way. With `arbitrary` both
        # paths apply our mask (ScaledMaskedSoftmax on GPU, attention_mask_func on CPU).
        super().__init__(local_config, layer_number, AttnMaskType.arbitrary, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection, **kwargs)
        # What this core computes is causal attention; only its softmax is told `arbitrary`.
        self.attn_mask_type = AttnMaskType.causal
        self.cp_group = cp_group
        self.cp_size = cp_size

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """query [s_local, b, heads / TP, head dim], key and value [s_local, b, query groups / TP, head
        dim] (sbhd, this CP rank's tokens in get_batch_on_this_cp_rank's order); attention_mask None or
        [b or 1, 1, s_local, S] (True = masked; get_batch_on_this_cp_rank's split of a [b, 1, S, S] mask),
        applied on top of the causal mask. Returns [s_local, b, hidden / TP], as DotProductAttention."""
        if self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        cp = self.cp_size
        if packed_seq_params is not None:
            raise ValueError(
                f"packed_seq_params (packed sequences, qkv_format={packed_seq_params.qkv_format!r}) with "
                f"context_parallel_size={cp}: not supported by ContextParallelAttention; use unpacked "
                f"[s, b, ...] sequences or context_parallel_size=1")
        if attention_bias is not None:
            raise ValueError(
                f"attention_bias of shape {tuple(attention_bias.shape)} with context_parallel_size={cp}: not "
                f"supported by ContextParallelAttention (nor by DotProductAttention); pass attention_bias=None")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(
                f"attn_mask_type={attn_mask_type} with context_parallel_size={cp}: ContextParallelAttention "
                f"does causal self-attention only; pass attn_mask_type=None or AttnMaskType.causal")
        s_local = query.size(0)
        if s_local % 2 or key.size(0) != s_local or value.size(0) != s_local:
            raise ValueError(
                f"query/key/value of {query.size(0)}/{key.size(0)}/{value.size(0)} tokens on a CP rank: each "
                f"must hold the same even count (two chunks of get_batch_on_this_cp_rank's split); make the "
                f"sequence length a multiple of 2 x context_parallel_size = {2 * cp}")
        seq = s_local * cp
        b = query.size(1)
        if attention_mask is not None and (
                attention_mask.dim() != 4 or attention_mask.size(0) not in (1, b) or attention_mask.size(1) != 1
                or tuple(attention_mask.shape[2:]) != (s_local, seq)):
            # Checked before the all-gather: every rank of the group refuses, none waits in a collective.
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} with context_parallel_size={cp}: "
                f"expected [b or 1, 1, s_local={s_local}, S={seq}] (get_batch_on_this_cp_rank's split of "
                f"a [b, 1, S, S] mask), or None for the causal mask alone")

        if self.cp_comm == RING:
            return ring_attention(query, key, value, attention_mask, self._ring_config())
        # Forward: all-gather along dim 0. Backward: reduce-scatter (sum): every rank's queries attend
        # to every rank's keys, so a rank's key/value gradient is the sum of all ranks' contributions.
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
        # Gathered: rank 0's two chunks, rank 1's, ... Into sequence order (the order of a given
        # attention_mask's columns): chunk r is rank r's first, chunk 2cp-1-r rank r's second. Views,
        # a flip and a cat: no index tensor to copy to the device.
        key = self._sequence_order(key)
        value = self._sequence_order(value)

        # Causal at the local queries' true positions: the query at position p sees keys 0..p
        # (True = masked, megatron's attention_mask_func convention).
        q_pos = local_positions(s_local, cp, self.cp_group.rank(), device=query.device)
        mask = (torch.arange(seq, device=query.device)[None, :] > q_pos[:, None])[None, None]  # [1, 1, s_local, S]
        if attention_mask is not None:
            # Masked where either masks: a causal mask from the data changes nothing, one reset at
            # document ends masks more. DotProductAttention's torch softmax applies a given mask in
            # place of the causal one: the same result for any mask that masks the future.
            mask = mask | attention_mask.to(torch.bool)
        return super().forward(query, key, value, mask, attn_mask_type=AttnMaskType.arbitrary)

    def _ring_config(self) -> RingConfig:
        """The ring's scale and dropout, as DotProductAttention applies them: q.k x softmax_scale, then x the
        query-key layer scaling coefficient inside its softmax; dropout on the probabilities in training, in
        the model-parallel RNG unless sequence parallelism is on."""
        from megatron.core import tensor_parallel

        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        rng = contextlib.nullcontext if self.config.sequence_parallel else tensor_parallel.get_cuda_rng_tracker().fork
        return RingConfig(self.cp_group, scale, self.attention_dropout.p if self.training else 0.0, rng)

    def _sequence_order(self, gathered: Tensor) -> Tensor:
        """[cp x s_local, ...] in the CP ranks' order -> [S, ...] in sequence order."""
        cp = self.cp_size
        halves = gathered.view(cp, 2, gathered.size(0) // (2 * cp), *gathered.shape[1:])
        return torch.cat([halves[:, 0], halves[:, 1].flip(0)]).view(gathered.shape)


def context_parallel_spec(spec):
    """A GPT layer spec or decoder block spec with ContextParallelAttention as the core attention of
    every layer whose core is megatron-core's local DotProductAttention (transformer-engine's core
    does CP itself and stays); a copy, the given spec untouched. Any other core is refused by name:
    it would run without CP and attend within each rank's chunks only."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hetermoe.compat import normalize_layer_spec

    def swap(layer):
        layer = copy.deepcopy(normalize_layer_spec(layer))
        attn = getattr(layer.submodules, "self_attention", None)
        core = getattr(getattr(attn, "submodules", None), "core_attention", None)
        target = core.module if isinstance(core, ModuleSpec) else core
        if target is DotProductAttention:
            attn.submodules.core_attention = ContextParallelAttention
        elif getattr(target, "__name__", "") != "TEDotProductAttention":
            raise ValueError(f"context parallelism with core attention {target!r}: not built; use the local "
                             f"or transformer-engine spec, or attention_cp 1")
        return layer

    layers = getattr(spec, "layer_specs", None)
    if layers is None:
        return swap(spec)
    block = copy.copy(spec)
    block.layer_specs = [swap(s) for s in layers]
    return block
