"""HeteroTokenDispatcher: megatron-core's MoETokenDispatcher interface over a ZP group, with
uneven splits and experts on other ranks (expert ranks, or this rank's offloaded experts).

What one microbatch's dispatch must remember until its combine is a frozen `DispatchMeta`
(routing map and probabilities in the layer's travel order, the permutation, the route). The
explicit methods `preprocess` and `postprocess` take and return it: zebra keeps one per
(layer, microbatch) in flight. Megatron's MoELayer.forward calls the interface methods one
microbatch at a time; they keep the current DispatchMeta on the dispatcher between calls.

Permutation never reads the routing map back to the host where the row count is known (dropless
top-k routing: every token picks exactly topk experts): megatron-core's fused permute where
config.moe_permute_fusion is set (transformer-engine), else `permute_dropless`, which gives
megatron-core's unfused permute's rows in its order without its masked_select. Token dropping or
padding makes the sizes data-dependent: there megatron-core's unfused permute (one read per
masked_select) stays.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_hetermoe.parallel.extension import Route
from megatron_hetermoe.parallel.state import HeteroParallelState


def permute_dropless(tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int,
                     probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """megatron-core's unfused moe_utils.permute without a host read, for a routing map with
    exactly `num_out_tokens` selections (dropless top-k: tokens x topk): the same rows in the same
    order (expert by expert, tokens ascending within an expert), bitwise, forward and backward.

    Returns (permuted tokens, permuted probs (None without `probs`), sorted_indices (the token of
    each row, as megatron-core's), flat_index (each row's position in the expert-major routing
    map: `unpermute_dropless` gathers the probabilities with it)). The k-th selection in
    expert-major order is the first position where the running count of selections reaches k:
    a cumsum and a searchsorted, both with sizes known to the host, where masked_select must
    read its output size back."""
    num_tokens = routing_map.shape[0]
    flat = routing_map.bool().t().reshape(-1)  # expert-major, the order masked_select reads the map in
    flat_index = torch.searchsorted(flat.cumsum(0),
                                    torch.arange(1, num_out_tokens + 1, device=routing_map.device))
    sorted_indices = flat_index % num_tokens if num_tokens else flat_index
    permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, flat_index)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices, flat_index


def unpermute_dropless(permuted: torch.Tensor, sorted_indices: torch.Tensor, flat_index: torch.Tensor,
                       restore_shape: torch.Size, probs: torch.Tensor | None = None) -> torch.Tensor:
    """megatron-core's unfused moe_utils.unpermute (weighted by `probs`, [tokens, experts] in the
    permutation's expert order) without its masked_select: the probabilities are gathered at
    `flat_index` (permute_dropless's) instead. Bitwise megatron-core's: the same weighting, in the
    promoted dtype, then its own scatter and the cast back."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    if probs is None:
        return unpermute(permuted, sorted_indices, restore_shape=restore_shape, fused=False)
    weighted = permuted * probs.t().reshape(-1).index_select(0, flat_index).unsqueeze(-1)
    return unpermute(weighted, sorted_indices, restore_shape=restore_shape, fused=False).to(permuted.dtype)


@dataclass(frozen=True)
class DispatchMeta:
    hidden_shape: torch.Size
    routing_map: torch.Tensor  # [tokens, experts in travel order]
    probs: torch.Tensor  # routing probabilities, same order; applied at combine
    per_expert: torch.Tensor  # tokens per expert (travel order), on the device: the counts exchange sends it
    sorted_indices: torch.Tensor  # the permutation of tokens into expert order (fused: TE's row map)
    route: Route | None = None  # the transport's handle, after the counts exchange
    # Where the experts weigh their outputs (probs permuted like the tokens), as Megatron's experts
    # do: only on MoELayer.forward's path in a ZP group of one; else None: `probs` apply after combine.
    permuted_probs: torch.Tensor | None = None
    # permute_dropless's row positions in the expert-major routing map (None: megatron-core's
    # permute made the rows, fused or unfused, and its unpermute undoes them).
    flat_index: torch.Tensor | None = None


class HeteroTokenDispatcher(MoETokenDispatcher):
    def __init__(self, config, hs: HeteroParallelState, layer: int, pg_collection):
        super().__init__(config=config, pg_collection=pg_collection)
        self.hs, self.layer = hs, layer
        self.order = hs.layer_order(layer)
        self._order_on: dict[torch.device, torch.Tensor] = {}  # self.order as an index, per device (built once)
        # Every expert of the layer on this one rank (a ZP group of one): the experts weight their
        # outputs, as Megatron's do, instead of three full-width multiplies after combine. In a
        # larger group they stay unweighted, so the gate's gradient needs no expert rank (the paper's).
        self.probs_in_experts = len(hs.zp.members) == 1
        # Dropless top-k routing sends exactly topk rows per token, known without reading the
        # routing map back to the host (Megatron's rule); dropping or padding routers change it.
        self.static_out = (getattr(config, "moe_expert_capacity_factor", None) is None
                           and not getattr(config, "moe_router_padding_for_quantization", False))
        self.meta: DispatchMeta | None = None  # the microbatch Megatron's MoELayer.forward is in

    def _order(self, device: torch.device) -> torch.Tensor:
        t = self._order_on.get(device)
        if t is None:
            t = self._order_on[device] = torch.tensor(self.order, device=device)
        return t

    # ---- explicit: one DispatchMeta per microbatch --------------------------------------------
    def preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                   weigh_in_experts: bool = False) -> tuple[DispatchMeta, torch.Tensor]:
        """Permute tokens by expert (travel order); returns (meta, permuted tokens). Reads nothing
        back to the host with dropless routing (module docstring): the split sizes come with the
        counts exchange.
        weigh_in_experts: permute the probabilities too, for the experts to apply (a ZP group of one)."""
        from megatron_hetermoe.compat import permute

        hidden = tokens.view(-1, tokens.shape[-1])
        order = self._order(routing_map.device)
        rmap = routing_map[:, order].contiguous()
        probs = probs[:, order]
        per_expert = rmap.sum(0)
        weigh = probs if weigh_in_experts else None
        out_rows = rmap.shape[0] * self.config.moe_router_topk if self.static_out else None
        flat_index = None
        if self.config.moe_permute_fusion:
            # transformer-engine's kernel sizes its output from the host: a read only where dropping
            # or padding leaves the row count to the data.
            permuted, permuted_probs, sorted_indices = permute(
                hidden, rmap, probs=weigh, num_out_tokens=out_rows if self.static_out else int(per_expert.sum()),
                fused=True)
        elif self.static_out:
            permuted, permuted_probs, sorted_indices, flat_index = permute_dropless(hidden, rmap, out_rows, weigh)
        else:  # data-dependent row count: megatron-core's masked_select reads it back
            permuted, permuted_probs, sorted_indices = permute(hidden, rmap, probs=weigh, fused=False)
        meta = DispatchMeta(tokens.shape, rmap, probs, per_expert, sorted_indices, permuted_probs=permuted_probs,
                            flat_index=flat_index)
        return meta, permuted

    def exchange_route(self, meta: DispatchMeta) -> DispatchMeta:
        # The wire dtype is params_dtype, as on the expert ranks (ExpertRuntime.forward_layer).
        route, _ = self.hs.transport.route(self.layer, meta.per_expert, meta.hidden_shape[-1],
                                           self.config.params_dtype)
        return dataclasses.replace(meta, route=route)

    def postprocess(self, meta: DispatchMeta, combined: torch.Tensor,
                    probs: torch.Tensor | None = None) -> torch.Tensor:
        """Unpermute the combined expert outputs, weighted by `probs` (default: meta's; none where
        the experts weighted them)."""
        from megatron.core.transformer.moe.moe_utils import unpermute

        if probs is None and meta.permuted_probs is None:
            probs = meta.probs
        shape = meta.hidden_shape
        restore = torch.Size([shape[:-1].numel(), shape[-1]])
        if meta.flat_index is not None:
            out = unpermute_dropless(combined, meta.sorted_indices, meta.flat_index, restore, probs)
        else:
            out = unpermute(combined, meta.sorted_indices, restore_shape=restore, probs=probs,
                            routing_map=meta.routing_map, fused=self.config.moe_permute_fusion)
        return out.view(shape)

    # ---- megatron-core's MoETokenDispatcher interface (MoELayer.forward) ------------------------
    def dispatch_preprocess(self, tokens, routing_map, probs):
        self.meta, permuted = self.preprocess(tokens, routing_map, probs, self.probs_in_experts)
        return permuted, self.meta.probs

    def token_dispatch(self, hidden_states, probs):
        self.meta = self.exchange_route(self.meta)
        return self.meta.route.dispatch(hidden_states), None

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self.meta.route.local_counts, self.meta.permuted_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return self.meta.route.combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        return self.postprocess(self.meta, hidden_states)
