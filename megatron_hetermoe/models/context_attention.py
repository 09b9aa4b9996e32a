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
- `a2a` (DeepSpeed-Ulysses, as transformer-engine does it): an all-to-all gives each CP rank the whole
  sequence of 1/cp of the heads, it attends with megatron-core's DotProductAttention, and an all-to-all
  returns its tokens of every head: the outputs are DotProductAttention's on the full sequence bit for
  bit. The heads per TP rank must divide by cp (query groups that do not are repeated to the heads
  first); a mask from the data is all-gathered over the CP group (every query's row).
- `a2a+p2p` (transformer-engine's hierarchical CP): not built here; those layers all-gather, and the
  log says so once per process.

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
from megatron_hetermoe.vocabulary import CpComm


_TOLD: set[str] = set()  # the cp_comm_type values already named in the log


def comm_of(cp_comm_type: Optional[str]) -> CpComm:
    """The communication this core does for a layer's cp_comm_type: the ring for p2p (and None, which
    transformer-engine reads as p2p), the all-gather for all_gather, the all-to-all for a2a, and (named
    in the log once per process) the all-gather for transformer-engine's a2a+p2p, not built here."""
    if cp_comm_type in (None, CpComm.P2P):
        return CpComm.P2P
    if cp_comm_type in (CpComm.ALL_GATHER, CpComm.A2A):
        return CpComm(cp_comm_type)
    if cp_comm_type != CpComm.A2A_P2P:
        raise ValueError(f"cp_comm_type={cp_comm_type!r} (--cp-comm-type): Megatron's values are p2p, all_gather, "
                         f"a2a and a2a+p2p")
    if cp_comm_type not in _TOLD:
        _TOLD.add(cp_comm_type)
        logging.getLogger(__name__).warning(
            "cp_comm_type=%r (--cp-comm-type) is transformer-engine's hierarchical CP communication; "
            "ContextParallelAttention (megatron-core's local attention core) all-gathers keys and values for those "
            "layers instead (the same numbers). Pass --cp-comm-type p2p (a ring), a2a or all_gather to choose, or "
            "use the transformer-engine spec.", cp_comm_type)
    return CpComm.ALL_GATHER


class ContextParallelAttention(DotProductAttention):
    """DotProductAttention with context parallelism over `pg_collection.cp` (causal self-attention only):
    a ring for cp_comm_type p2p or None, an all-gather of keys and values for all_gather (and for
    a2a+p2p, named in the log once), an all-to-all of heads for a2a. Constructor and forward take
    DotProductAttention's arguments; extra keywords go to DotProductAttention (k_channels / v_channels where
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
            self.cp_comm: Optional[CpComm] = None
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
        if self.cp_comm in (CpComm.P2P, CpComm.A2A) and getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"softmax_type={config.softmax_type!r} with cp_comm_type={cp_comm_type!r}: the ring merges "
                f"vanilla softmaxes only, and the all-to-all keeps no per-head offsets; pass --cp-comm-type "
                f"all_gather, or softmax_type 'vanilla'")
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
        if self.cp_comm == CpComm.A2A:
            self._init_a2a(local_config, layer_number, attention_type, attention_dropout, softmax_scale,
                           pg_collection, **kwargs)

    def _init_a2a(self, local_config: TransformerConfig, layer_number: int, attention_type: str,
                  attention_dropout: Optional[float], softmax_scale: Optional[float],
                  pg_collection: ProcessGroupCollection, **kwargs: Any) -> None:
        """The all-to-all's core: DotProductAttention over the whole sequence for 1/cp of this TP rank's
        heads (and of its query groups where they divide by cp; else the groups are repeated to the
        heads before the exchange). A child module without parameters: train()/eval() reach it."""
        cp, heads, groups = self.cp_size, self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if heads % cp:
            raise ValueError(
                f"cp_comm_type='a2a' with {heads} attention heads per tensor-parallel rank and "
                f"context_parallel_size={cp}: the all-to-all gives each CP rank heads / cp of them; use a CP size "
                f"that divides {heads}, or --cp-comm-type p2p")
        self.a2a_repeat_kv = groups % cp != 0
        inner = copy.copy(local_config)
        inner.num_attention_heads = local_config.num_attention_heads // cp
        inner.num_query_groups = (inner.num_attention_heads if self.a2a_repeat_kv
                                  else local_config.num_query_groups // cp)
        self.a2a_core = DotProductAttention(inner, layer_number, AttnMaskType.arbitrary, attention_type,
                                            attention_dropout, softmax_scale, None, pg_collection, **kwargs)

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

        if self.cp_comm == CpComm.P2P:
            return ring_attention(query, key, value, attention_mask, self._ring_config())
        if self.cp_comm == CpComm.A2A:
            return self._a2a_forward(query, key, value, attention_mask)
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

    def _a2a_forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
        """Ulysses: this rank's tokens of every head -> the whole sequence of heads / cp of them, causal
        attention there (the mask's rows of every CP rank all-gathered), and back."""
        cp, s_local = self.cp_size, query.size(0)
        if self.a2a_repeat_kv:
            rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        q, k, v = (self._heads_to_sequence(t) for t in (query, key, value))
        seq = s_local * cp
        mask = torch.ones(seq, seq, dtype=torch.bool, device=query.device).triu(1)[None, None]  # the future
        if attention_mask is not None:
            rows = attention_mask.to(torch.uint8).contiguous()  # gloo all-gathers no bool
            got = [torch.empty_like(rows) for _ in range(cp)]
            torch.distributed.all_gather(got, rows, group=self.cp_group)
            # [b, 1, cp x s_local, S] in the CP ranks' order -> rows in sequence order
            mask = mask | self._sequence_order(torch.cat(got, dim=2).transpose(0, 2)).transpose(0, 2).to(torch.bool)
        out = self.a2a_core(q, k, v, mask, attn_mask_type=AttnMaskType.arbitrary)  # [S, b, heads / cp x hn]
        # [S, b, heads / cp, the values' head dim] (MLA's differs from the queries')
        return self._sequence_to_heads(out.view(seq, out.size(1), q.size(2), v.size(3)))

    def _heads_to_sequence(self, t: Tensor) -> Tensor:
        """[s_local, b, n, hn] (this rank's tokens, all n heads) -> [S, b, n / cp, hn] (the whole sequence in
        sequence order, this CP rank's n / cp heads): part j of the heads goes to CP rank j."""
        from megatron.core.tensor_parallel.mappings import all_to_all

        cp = self.cp_size
        s_local, b, n, hn = t.shape
        parts = t.reshape(s_local, b, cp, n // cp, hn).permute(2, 0, 1, 3, 4).reshape(cp * s_local, b, n // cp, hn)
        return self._sequence_order(all_to_all(self.cp_group, parts))

    def _sequence_to_heads(self, t: Tensor) -> Tensor:
        """_heads_to_sequence's inverse, heads flattened: [S, b, n', hn] -> [s_local, b, cp x n' x hn]."""
        from megatron.core.tensor_parallel.mappings import all_to_all

        cp = self.cp_size
        seq, b, n, hn = t.shape
        mine = all_to_all(self.cp_group, self._rank_order(t))  # part i: this rank's tokens of CP rank i's heads
        return mine.view(cp, seq // cp, b, n, hn).permute(1, 2, 0, 3, 4).reshape(seq // cp, b, cp * n * hn)

    def _rank_order(self, t: Tensor) -> Tensor:
        """_sequence_order's inverse: [S, ...] in sequence order -> [cp x s_local, ...] in the CP ranks' order."""
        cp = self.cp_size
        chunks = t.view(2 * cp, t.size(0) // (2 * cp), *t.shape[1:])
        return torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=1).reshape(t.shape)

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
