"""The one place that cuts megatron-core's GPT layers into zebra's stages.

An attention rank's forward of one microbatch is L+1 stages: stage 0 = embedding + layer 0's
attention + router + permute; stage s = combine of layer s-1 (unpermute with the routing
probabilities, the MLP's bias-dropout-add onto the residual) + layer s's attention + router +
permute; stage L = combine of layer L-1 + final norm + output head and loss. L counts MoE layers: the
model's dense layers (--moe-layer-freq) run whole, as TransformerBlock runs them, inside the stage
that reaches them (before the next MoE layer's attention, or before the final norm). Zebra detaches
between stages (schedules/zebra.py), so each piece here is a plain differentiable function.

Each stage runs the code GPTModel.forward runs for it, with the same inputs: stage 0 is
GPTModel._preprocess (the embedding, with learned absolute positions where the model has them,
and the rotary embedding of the model's --position-embedding-type: rope, yarn, mrope, or none),
and every layer's attention gets the batch's attention mask (e.g. --reset-attention-mask's
document mask) and that rotary embedding, as TransformerBlock hands them to its layers.

megatron-core has no public per-piece API for a TransformerLayer in 0.16-0.19: these call
GPTModel._preprocess / _postprocess and TransformerLayer._forward_attention /
_forward_pre_mlp_layernorm / _forward_post_mlp (what its own fine-grained callables for the 1F1B
A2A overlap use too; those drive megatron's dispatcher and schedule, not a disaggregated one).
tests/canary_step.py and the compat tests fail first when a release changes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageContext:
    """What every stage of one microbatch reads besides its hidden states, as GPTModel.forward
    passes it to its decoder: the batch's attention mask and packed-sequence parameters, and the
    rotary embedding _preprocess made (all None for learned_absolute and none)."""
    attention_mask: torch.Tensor | None = None
    packed_seq_params: object | None = None
    rotary_pos_emb: torch.Tensor | None = None
    rotary_pos_cos: torch.Tensor | None = None
    rotary_pos_sin: torch.Tensor | None = None
    sequence_len_offset: torch.Tensor | None = None

    def layer_kwargs(self) -> dict:
        return {"attention_mask": self.attention_mask, "rotary_pos_emb": self.rotary_pos_emb,
                "rotary_pos_cos": self.rotary_pos_cos, "rotary_pos_sin": self.rotary_pos_sin,
                "packed_seq_params": self.packed_seq_params, "sequence_len_offset": self.sequence_len_offset}


class AttentionStages:
    """Stage functions of a GPTModel built with HeteroMoELayer (models/moe_layer.py)."""

    def __init__(self, gpt):
        from megatron_hetermoe.models.moe_layer import HeteroMoELayer

        self.gpt = gpt
        every = list(gpt.decoder.layers)
        moe = [i for i, tl in enumerate(every) if isinstance(tl.mlp, HeteroMoELayer)]
        if not moe:
            raise ValueError("the model has no MoE layer: zebra's stages are cut at MoE layers")
        self.layers = [every[i] for i in moe]  # MoE layer k: stages and tasks count these
        # The dense layers each stage runs before MoE layer k's attention; the last entry: before the head.
        bounds = [-1, *moe, len(every)]
        self.dense = [every[a + 1:b] for a, b in zip(bounds, bounds[1:])]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def _run_dense(layers, hidden: torch.Tensor, ctx: StageContext) -> torch.Tensor:
        for tl in layers:
            hidden, _ = tl(hidden_states=hidden, **ctx.layer_kwargs())
        return hidden

    def embed(self, batch: dict, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, StageContext]:
        """Stage 0's start: GPTModel._preprocess on the batch (embedding, rotary embedding). On a
        pipeline stage after the first, `hidden` is the previous stage's output, which _preprocess
        passes through as GPTModel.forward's decoder input (the rotary embedding is still made)."""
        out = self.gpt._preprocess(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                                   decoder_input=hidden, packed_seq_params=batch.get("packed_seq_params"))
        if len(out) > 6:  # flashinfer's fused rope: inference only
            raise NotImplementedError("zebra runs training passes; GPTModel._preprocess returned inference-only "
                                      "rotary tensors (flashinfer fused rope)")
        hidden, emb, cos, sin, offset = out[:5]
        return hidden, StageContext(batch.get("attention_mask"), batch.get("packed_seq_params"), emb, cos, sin, offset)

    def attention_and_route(self, layer: int, hidden: torch.Tensor, ctx: StageContext):
        """Layer `layer` up to dispatch: returns (DispatchMeta, permuted tokens, residual,
        routing probabilities in travel order, the shared experts' output or None). The shared
        experts run here, on the attention rank (Megatron's MoELayer computes them before the
        dispatch too); under zebra, other microbatches' transfers overlap them."""
        hidden = self._run_dense(self.dense[layer], hidden, ctx)
        tl = self.layers[layer]
        hidden, _ = tl._forward_attention(hidden, **ctx.layer_kwargs())
        pre = tl._forward_pre_mlp_layernorm(hidden)
        probs, routing_map = tl.mlp.route(pre)
        meta, permuted = tl.mlp.token_dispatcher.preprocess(pre, routing_map, probs)
        return meta, permuted, hidden, meta.probs, tl.mlp.shared_experts_compute(pre)

    def combine(self, layer: int, meta, combined: torch.Tensor, residual: torch.Tensor,
                probs: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer` after combine: unpermute with `probs`, add the shared experts' output
        (as MoELayer.postprocess), then bias-dropout-add onto the residual."""
        tl = self.layers[layer]
        out = tl.mlp.token_dispatcher.postprocess(meta, combined, probs)
        if shared is not None:
            out = out + shared
        return tl._forward_post_mlp((out, None), residual)

    def head(self, hidden: torch.Tensor, batch: dict, ctx: StageContext) -> torch.Tensor:
        """The last piece: the dense layers after the last MoE layer, then on the last pipeline
        stage the final norm and output layer (GPTModel._postprocess's logits or loss); on an
        earlier stage the hidden states that go to the next stage (_postprocess returns them)."""
        hidden = self._run_dense(self.dense[-1], hidden, ctx)
        final = self.gpt.decoder.final_layernorm
        if final is not None:
            hidden = final(hidden)
        return self.gpt._postprocess(hidden_states=hidden, input_ids=batch["tokens"],
                                     position_ids=batch["position_ids"], labels=batch["labels"],
                                     rotary_pos_emb=ctx.rotary_pos_emb, rotary_pos_cos=ctx.rotary_pos_cos,
                                     rotary_pos_sin=ctx.rotary_pos_sin, loss_mask=batch.get("loss_mask"),
                                     attention_mask=ctx.attention_mask, packed_seq_params=ctx.packed_seq_params,
                                     sequence_len_offset=ctx.sequence_len_offset)
