"""HeteroTokenDispatcher: megatron-core's MoETokenDispatcher interface over a ZP group, with
uneven splits and experts on other ranks (expert ranks, or this rank's offloaded experts).

What one microbatch's dispatch must remember until its combine is a frozen `DispatchMeta`
(routing map and probabilities in the layer's travel order, the permutation, the route). The
explicit methods `preprocess` and `postprocess` take and return it: zebra keeps one per
(layer, microbatch) in flight. Megatron's MoELayer.forward calls the interface methods one
microbatch at a time; they keep the current DispatchMeta on the dispatcher between calls.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_hetermoe.parallel.comm import TokenRoute
from megatron_hetermoe.parallel.state import HeteroParallelState


@dataclass(frozen=True)
class DispatchMeta:
    hidden_shape: torch.Size
    routing_map: torch.Tensor  # [tokens, experts in travel order]
    probs: torch.Tensor  # routing probabilities, same order; applied at combine
    per_expert: torch.Tensor  # tokens per expert (travel order)
    sorted_indices: torch.Tensor  # the permutation of tokens into expert order (fused: TE's row map)
    send_splits: tuple[int, ...]  # rows to each member of the ZP group (comm order)
    route: TokenRoute | None = None  # after the counts exchange


class HeteroTokenDispatcher(MoETokenDispatcher):
    def __init__(self, config, hs: HeteroParallelState, layer: int, pg_collection):
        super().__init__(config=config, pg_collection=pg_collection)
        self.hs, self.layer = hs, layer
        self.order = hs.layer_order(layer)
        # the k-th rank of comm_order holds the next member_sizes[k] experts of self.order
        self.member_sizes = [len(hs.zp.placement[layer].get(r, [])) for r in hs.comm_order]
        self.meta: DispatchMeta | None = None  # the microbatch Megatron's MoELayer.forward is in

    # ---- explicit: one DispatchMeta per microbatch --------------------------------------------
    def preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                   probs: torch.Tensor) -> tuple[DispatchMeta, torch.Tensor]:
        """Permute tokens by expert (travel order); returns (meta, permuted tokens)."""
        from megatron_hetermoe.compat import permute

        hidden = tokens.view(-1, tokens.shape[-1])
        order = torch.tensor(self.order, device=routing_map.device)
        rmap = routing_map[:, order].contiguous()
        per_expert = rmap.sum(0)
        permuted, _, sorted_indices = permute(hidden, rmap, num_out_tokens=int(per_expert.sum()),
                                              fused=self.config.moe_permute_fusion)
        splits, start = [], 0
        for s in self.member_sizes:
            splits.append(int(per_expert[start:start + s].sum()))
            start += s
        meta = DispatchMeta(tokens.shape, rmap, probs[:, order], per_expert, sorted_indices, tuple(splits))
        return meta, permuted

    def exchange_route(self, meta: DispatchMeta) -> DispatchMeta:
        # The wire dtype is params_dtype, as on the expert ranks (ExpertRuntime.forward_layer).
        route, _ = TokenRoute.exchange(self.hs, self.layer, meta.per_expert, list(meta.send_splits),
                                       meta.hidden_shape[-1], self.config.params_dtype)
        return dataclasses.replace(meta, route=route)

    def postprocess(self, meta: DispatchMeta, combined: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """Unpermute the combined expert outputs, weighted by `probs` (default: meta's)."""
        from megatron.core.transformer.moe.moe_utils import unpermute

        shape = meta.hidden_shape
        out = unpermute(combined, meta.sorted_indices, restore_shape=torch.Size([shape[:-1].numel(), shape[-1]]),
                        probs=meta.probs if probs is None else probs, routing_map=meta.routing_map,
                        fused=self.config.moe_permute_fusion)
        return out.view(shape)

    # ---- megatron-core's MoETokenDispatcher interface (MoELayer.forward) ------------------------
    def dispatch_preprocess(self, tokens, routing_map, probs):
        self.meta, permuted = self.preprocess(tokens, routing_map, probs)
        return permuted, self.meta.probs

    def token_dispatch(self, hidden_states, probs):
        self.meta = self.exchange_route(self.meta)
        return self.meta.route.dispatch(hidden_states), None

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self.meta.route.local_counts, None

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return self.meta.route.combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        return self.postprocess(self.meta, hidden_states)
