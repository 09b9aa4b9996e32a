"""The one place that cuts megatron-core's GPT layers into zebra's stages.

An attention rank's forward of one microbatch is L+1 stages: stage 0 = embedding + layer 0's
attention + router + permute; stage s = combine of layer s-1 (unpermute with the routing
probabilities, the MLP's bias-dropout-add onto the residual) + layer s's attention + router +
permute; stage L = combine of layer L-1 + final norm + output head and loss. Zebra detaches
between stages (schedules/zebra.py), so each piece here is a plain differentiable function.

megatron-core has no public per-piece API for a TransformerLayer in 0.16-0.19: these call
TransformerLayer._forward_attention / _forward_pre_mlp_layernorm / _forward_post_mlp and
GPTModel._postprocess (what its own fine-grained callables for the 1F1B A2A overlap use too;
those drive megatron's dispatcher and schedule, not a disaggregated one). tests/canary_step.py and
the compat tests fail first when a release changes them.
"""
from __future__ import annotations

import torch


class AttentionStages:
    """Stage functions of a GPTModel built with HeteroMoELayer (models/moe_layer.py)."""

    def __init__(self, gpt):
        self.gpt = gpt
        self.layers = gpt.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rotary(self, seq_len: int):
        return self.gpt.rotary_pos_emb(seq_len)

    def embed(self, batch: dict) -> torch.Tensor:
        return self.gpt.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])

    def attention_and_route(self, layer: int, hidden: torch.Tensor, rope):
        """Layer `layer` up to dispatch: returns (DispatchMeta, permuted tokens, residual,
        routing probabilities in travel order)."""
        tl = self.layers[layer]
        hidden, _ = tl._forward_attention(hidden, attention_mask=None, rotary_pos_emb=rope)
        pre = tl._forward_pre_mlp_layernorm(hidden)
        probs, routing_map = tl.mlp.route(pre)
        meta, permuted = tl.mlp.token_dispatcher.preprocess(pre, routing_map, probs)
        return meta, permuted, hidden, meta.probs

    def combine(self, layer: int, meta, combined: torch.Tensor, residual: torch.Tensor,
                probs: torch.Tensor) -> torch.Tensor:
        """Layer `layer` after combine: unpermute with `probs`, then bias-dropout-add onto the
        residual."""
        tl = self.layers[layer]
        out = tl.mlp.token_dispatcher.postprocess(meta, combined, probs)
        return tl._forward_post_mlp((out, None), residual)

    def head(self, hidden: torch.Tensor, batch: dict, rope) -> torch.Tensor:
        hidden = self.gpt.decoder.final_layernorm(hidden)
        return self.gpt._postprocess(hidden_states=hidden, input_ids=batch["tokens"], position_ids=batch["position_ids"],
                                     labels=batch["labels"], rotary_pos_emb=rope, rotary_pos_cos=None,
                                     rotary_pos_sin=None)
