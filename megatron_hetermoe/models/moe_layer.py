"""HeteroMoELayer: megatron-core's MoELayer with the disaggregated attention->expert dispatcher.

Installed through the layer spec (`hetero_layer_spec`). On an attention rank the router runs
here; tokens travel to whichever member of the ZP group holds their expert (expert ranks, or
this rank's own offloaded experts) and come back to be combined with the routing
probabilities. Megatron's MoELayer.forward drives the dispatcher methods unchanged.
"""
from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_hetermoe.compat import normalize_layer_spec, set_moe_layer
from megatron_hetermoe.models.experts import build_experts, run_local_experts
from megatron_hetermoe.parallel.comm import exchange, exchange_counts
from megatron_hetermoe.parallel.state import HeteroParallelState

# TransformerLayer passes pg_collection only to exactly MoELayer and logs "Unknown MLP type"
# for any subclass; the spec hands HeteroMoELayer its groups, so the warning says nothing.
logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
    lambda rec: "Unknown MLP type" not in rec.getMessage()
)


class HeteroTokenDispatcher(MoETokenDispatcher):
    """Dispatch and combine over a ZP group with uneven splits. The per-microbatch state kept
    between dispatch and combine lives in `self.state` (one dict per call in flight)."""

    def __init__(self, config, hs: HeteroParallelState, layer: int, pg_collection):
        super().__init__(config=config, pg_collection=pg_collection)
        self.hs, self.layer = hs, layer
        self.order = hs.layer_order(layer)
        # the k-th rank of comm_order holds the next sizes[k] experts of self.order
        sizes = [len(hs.zp.placement[layer].get(r, [])) for r in hs.comm_order]
        self.member_sizes = sizes
        self.state: dict = {}

    def dispatch_preprocess(self, tokens, routing_map, probs):
        from megatron_hetermoe.compat import permute

        st = self.state
        st["hidden_shape"] = tokens.shape
        hidden = tokens.view(-1, tokens.shape[-1])
        order = torch.tensor(self.order)
        st["routing_map"] = routing_map[:, order].contiguous()
        st["probs"] = probs[:, order]
        per_expert = st["routing_map"].sum(0)
        st["per_expert"] = per_expert
        permuted, _, sorted_indices = permute(hidden, st["routing_map"], num_out_tokens=int(per_expert.sum()))
        st["sorted_indices"] = sorted_indices
        splits, start = [], 0
        for s in self.member_sizes:
            splits.append(int(per_expert[start:start + s].sum()))
            start += s
        st["send_splits"] = splits
        return permuted, st["probs"]

    def token_dispatch(self, hidden_states, probs):
        st, hs = self.state, self.hs
        counts = exchange_counts(st["per_expert"], hs.dispatch_group)
        st["local_counts"] = hs.received_counts(self.layer, counts)
        st["recv_splits"] = st["local_counts"].sum(1).tolist()
        recv = exchange(hidden_states, st["recv_splits"], st["send_splits"], hs.dispatch_group, hs.combine_group)
        return recv, None

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self.state["local_counts"], None

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        st, hs = self.state, self.hs
        return exchange(hidden_states, st["send_splits"], st["recv_splits"], hs.combine_group, hs.dispatch_group)

    def combine_postprocess(self, hidden_states):
        from megatron.core.transformer.moe.moe_utils import unpermute

        st = self.state
        shape = st["hidden_shape"]
        out = unpermute(hidden_states, st["sorted_indices"], restore_shape=torch.Size([shape[:-1].numel(), shape[-1]]),
                        probs=st["probs"], routing_map=st["routing_map"])
        return out.view(shape)


class _NoExperts(torch.nn.Module):
    """Placeholder so MoELayer.__init__ does not build all experts on an attention rank."""

    def __init__(self, *args, **kwargs):
        super().__init__()


class HeteroMoELayer(MoELayer):
    def __init__(self, config, submodules: MoESubmodules, layer_number: Optional[int] = None,
                 pg_collection=None, hetero_state: HeteroParallelState | None = None, **kwargs):
        # kwargs: what newer TransformerLayers pass to every mlp (0.18+: is_mtp_layer, name).
        if pg_collection is None or hetero_state is None:
            raise ValueError("HeteroMoELayer needs pg_collection and hetero_state; build it with hetero_layer_spec()")
        self.hs = hetero_state
        self._experts_spec = submodules.experts
        sub = copy.copy(submodules)
        sub.experts = _NoExperts
        super().__init__(config, sub, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        self._pgc = pg_collection
        self.experts = None
        self.token_dispatcher = None  # set once the layer knows its number

    def set_layer_number(self, layer_number: int):
        super().set_layer_number(layer_number)
        layer = layer_number - 1
        self.token_dispatcher = HeteroTokenDispatcher(self.config, self.hs, layer, self._pgc)
        mine = self.hs.local_experts(layer)
        self.local_expert_indices = mine
        self.num_local_experts = len(mine)
        self.experts = build_experts(self.config, self._experts_spec, len(mine), self._pgc) if mine else None

    def routed_experts_compute(self, hidden_states, probs):
        _, counts, _ = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        if self.experts is None:
            return hidden_states, None  # nothing lands here: an empty [0, H] passes through
        return run_local_experts(self.experts, hidden_states, counts), None

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        if self.experts is not None and routed_experts:
            self.experts.backward_dw()


def hetero_layer_spec(base_spec, hs: HeteroParallelState, pg_collection):
    """The GPT layer spec with HeteroMoELayer in place of MoELayer."""
    spec = copy.deepcopy(normalize_layer_spec(base_spec))
    set_moe_layer(spec, HeteroMoELayer, pg_collection=pg_collection, hetero_state=hs)
    return spec
