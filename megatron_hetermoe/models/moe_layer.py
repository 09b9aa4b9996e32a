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

from megatron_hetermoe.compat import normalize_layer_spec, set_moe_layer
from megatron_hetermoe.models.dispatcher import HeteroTokenDispatcher
from megatron_hetermoe.models.experts import build_experts, recomputes_experts, run_local_experts
from megatron_hetermoe.parallel.state import HeteroParallelState

# TransformerLayer passes pg_collection only to exactly MoELayer and logs "Unknown MLP type"
# for any subclass; the spec hands HeteroMoELayer its groups, so the warning says nothing.
logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
    lambda rec: "Unknown MLP type" not in rec.getMessage()
)


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
        # Megatron's MoE-layer recomputation would checkpoint forward() whole and replay the dispatch,
        # which the expert ranks do not mirror: the experts recompute instead (recomputes_experts).
        self.moe_layer_recompute = False
        self.experts = None
        self.token_dispatcher = None  # set once the layer knows its number

    def set_layer_number(self, layer_number: int):
        super().set_layer_number(layer_number)
        layer = self.hs.plan.moe_index(layer_number - 1)  # the plan counts MoE layers (dense ones have an MLP)
        if layer is None:
            raise ValueError(f"model layer {layer_number - 1} is an MoE layer of the model but a dense layer of the "
                             f"plan (dense_layers={self.hs.plan.dense_layers}); remake the plan for this model's "
                             f"--moe-layer-freq")
        self.token_dispatcher = HeteroTokenDispatcher(self.config, self.hs, layer, self._pgc)
        mine = self.hs.local_experts(layer)
        self.local_expert_indices = mine
        self.num_local_experts = len(mine)
        self.experts = build_experts(self.config, self._experts_spec, len(mine), self._pgc) if mine else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """MoELayer's, with the experts this rank holds (Asym-EA) under the plan's expert ids."""
        import torch.distributed as dist

        from megatron_hetermoe.models.experts import experts_sharded_state_dict

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.experts is not None:
            mine = f"{prefix}experts."
            sd = {k: v for k, v in sd.items() if not k.startswith(mine)}
            sd.update(experts_sharded_state_dict(self.experts, self.local_expert_indices, self.config.num_moe_experts,
                                                 dist.get_rank(self.hs.group("replica")), mine, sharded_offsets,
                                                 metadata))
        return sd

    def routed_experts_compute(self, hidden_states, probs):
        _, counts, permuted_probs = self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
        if self.experts is None:
            return hidden_states, None  # nothing lands here: an empty [0, H] passes through
        return run_local_experts(self.experts, hidden_states, counts, permuted_probs,
                                 recompute=recomputes_experts(self.config, self.hs.plan)), None

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        if self.experts is not None and routed_experts:
            self.experts.backward_dw()


def hetero_layer_spec(base_spec, hs: HeteroParallelState, pg_collection):
    """The GPT layer spec with HeteroMoELayer in place of MoELayer."""
    spec = copy.deepcopy(normalize_layer_spec(base_spec))
    set_moe_layer(spec, HeteroMoELayer, pg_collection=pg_collection, hetero_state=hs)
    return spec


def is_moe_layer_spec(layer_spec) -> bool:
    """Whether a GPT layer spec's mlp is an MoE layer (it has experts), not a dense MLP."""
    sub = getattr(normalize_layer_spec(layer_spec).submodules.mlp, "submodules", None)
    return hasattr(sub, "experts")


def moe_layer_specs(spec) -> list:
    """The layer specs of a GPT layer spec (every layer alike) or of a decoder block spec
    (Megatron's get_gpt_decoder_block_spec: dense and MoE layers by --moe-layer-freq) that are MoE."""
    layers = getattr(spec, "layer_specs", None)
    return [s for s in (layers if layers is not None else [spec]) if is_moe_layer_spec(s)]


def hetero_block_spec(spec, hs: HeteroParallelState, pg_collection, vp_stage: int | None = None):
    """GPTModel's transformer_layer_spec with HeteroMoELayer in every MoE layer: `spec` is a
    layer spec (every layer an MoE layer) or a decoder block spec whose MoE layers must be the
    plan's (model layers, dense_layers; of one pipeline stage, or of its model chunk `vp_stage`
    with virtual stages)."""
    layers = getattr(spec, "layer_specs", None)
    if layers is None:
        if hs.plan.dense_layers:
            raise ValueError(f"the plan has dense layers {hs.plan.dense_layers} but the model was given one layer "
                             f"spec for every layer; build it from the decoder block spec of its --moe-layer-freq")
        return hetero_layer_spec(spec, hs, pg_collection)
    pattern = [is_moe_layer_spec(s) for s in layers]
    model_layers = range(hs.plan.decoder_layers)
    if hs.plan.pipeline_stages > 1 and len(layers) != hs.plan.decoder_layers:
        # Megatron's block spec of one pipeline stage, or of one of its model chunks
        model_layers = [i for i in (hs.plan.stage_model_layers(hs.stage) if vp_stage is None
                                    else hs.plan.chunk_model_layers(hs.stage, vp_stage))
                        if i < hs.plan.decoder_layers]  # the MTP layers are the MTP block's
    want = [hs.plan.moe_index(i) is not None for i in model_layers]
    if pattern != want:
        raise ValueError(f"the model's MoE layers {[i for i, m in enumerate(pattern) if m]} of {len(pattern)} are not "
                         f"the plan's {[i for i, m in enumerate(want) if m]} of {hs.plan.decoder_layers}; remake the "
                         f"plan for this model's --num-layers and --moe-layer-freq")
    block = copy.copy(spec)
    block.layer_specs = [hetero_layer_spec(s, hs, pg_collection) if m else s for s, m in zip(layers, pattern)]
    return block


def hetero_mtp_block_spec(spec, hs: HeteroParallelState, pg_collection):
    """Megatron's MTP block spec (get_gpt_mtp_block_spec: one MultiTokenPredictionLayer spec per MTP
    layer, each around a TransformerLayer spec) with HeteroMoELayer in every MoE transformer layer;
    MTP layer k is the plan's model layer decoder_layers + k."""
    layers = list(spec.layer_specs)
    if len(layers) != hs.plan.mtp_layers:
        raise ValueError(f"the model has {len(layers)} MTP layers but the plan {hs.plan.mtp_layers}; remake the plan "
                         f"for this model's --mtp-num-layers")
    block = copy.copy(spec)
    block.layer_specs = []
    for k, mtp_layer in enumerate(layers):
        inner = mtp_layer.submodules.transformer_layer
        moe = is_moe_layer_spec(inner)
        if moe != (hs.plan.moe_index(hs.plan.decoder_layers + k) is not None):
            raise ValueError(f"MTP layer {k} (model layer {hs.plan.decoder_layers + k}) is "
                             f"{'an MoE' if moe else 'a dense'} layer of the model but not of the plan "
                             f"(dense_layers={hs.plan.dense_layers}); remake the plan for this model")
        mtp_layer = copy.copy(mtp_layer)
        mtp_layer.submodules = copy.copy(mtp_layer.submodules)
        if moe:
            mtp_layer.submodules.transformer_layer = hetero_layer_spec(inner, hs, pg_collection)
        block.layer_specs.append(mtp_layer)
    return block
