"""The one place that cuts megatron-core's GPT layers into zebra's stages.

An attention rank's forward of one microbatch is L+1 stages: stage 0 = embedding + layer 0's
attention + router + permute; stage s = combine of layer s-1 (unpermute with the routing
probabilities, the MLP's bias-dropout-add onto the residual) + layer s's attention + router +
permute; stage L = combine of layer L-1 + final norm + output head and loss. L counts MoE layers,
the multi-token prediction (MTP) block's included: the model's dense layers (--moe-layer-freq) run
whole, as TransformerBlock runs them, inside the stage that reaches them, and so do the steps
around an MTP layer's transformer layer (the decoder's final norm, each MTP layer's embedding of
the shifted tokens, norms and projection, its final norm; a dense MTP layer whole). Zebra detaches
between stages (schedules/zebra.py), so each piece here is a plain differentiable function; what a
stage passes on besides the hidden states and the MoE layer's pieces is its `carry`: the decoder's
output and each MTP layer's, which the head concatenates as GPTModel._postprocess reads them.

Each stage runs the code GPTModel.forward runs for it, with the same inputs: stage 0 is
GPTModel._preprocess (the embedding, with learned absolute positions where the model has them,
and the rotary embedding of the model's --position-embedding-type: rope, yarn, mrope, or none),
and every layer's attention gets the batch's attention mask (e.g. --reset-attention-mask's
document mask) and that rotary embedding, as TransformerBlock hands them to its layers; an MTP
layer k reads the tokens and positions rolled k + 1 times, as MultiTokenPredictionBlock feeds them.

megatron-core has no public per-piece API for a TransformerLayer in 0.16-0.19: these call
GPTModel._preprocess / _postprocess, TransformerLayer._forward_attention /
_forward_pre_mlp_layernorm / _forward_post_mlp and MultiTokenPredictionLayer._get_embeddings /
_concat_embeddings / _postprocess (what its own fine-grained callables for the 1F1B A2A overlap
use too; those drive megatron's dispatcher and schedule, not a disaggregated one).
tests/canary_step.py and the compat tests fail first when a release changes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_hetermoe import compat


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


def _mtp_transformer_layer(mtp_layer):
    """An MTP layer's transformer layer: `transformer_layer` in megatron-core 0.16-0.18,
    `mtp_model_layer` from 0.19 (a hybrid MTP layer pattern is refused)."""
    if getattr(mtp_layer, "mtp_layer_pattern", None) is not None:
        raise NotImplementedError("zebra cuts GPT MTP layers; a hybrid MTP layer pattern "
                                  "(--mtp-hybrid-override-pattern) has no stages; use --hetero-schedule distep")
    return getattr(mtp_layer, "transformer_layer", None) or mtp_layer.mtp_model_layer


class AttentionStages:
    """Stage functions of a GPTModel built with HeteroMoELayer (models/moe_layer.py).

    The model as a walk of steps (`_steps`): ("dense", layer), ("moe", k) for MoE layer k's
    attention-and-route / combine cut, ("final_norm",), ("mtp_pre", m), ("mtp_post", m) and
    ("mtp_whole", m) for MTP layer m. Stage k runs the steps between MoE layer k-1's cut and MoE
    layer k's (`before[k]`; `before[L]`: before the head)."""

    def __init__(self, gpt):
        from megatron_hetermoe.models.moe_layer import HeteroMoELayer

        self.gpt = gpt
        self.mtp = list(gpt.mtp.layers) if getattr(gpt, "mtp_process", False) else []
        steps: list[tuple] = []
        self.layers = []  # MoE layer k's TransformerLayer: stages and tasks count these
        self.mtp_of: list[int | None] = []  # MoE layer k -> its MTP layer (None: a decoder layer)
        for tl in gpt.decoder.layers:
            if isinstance(tl.mlp, HeteroMoELayer):
                steps.append(("moe", len(self.layers)))
                self.layers.append(tl)
                self.mtp_of.append(None)
            else:
                steps.append(("dense", tl))
        steps.append(("final_norm",))
        for m, layer in enumerate(self.mtp):
            tl = _mtp_transformer_layer(layer)
            if isinstance(tl.mlp, HeteroMoELayer):
                steps += [("mtp_pre", m), ("moe", len(self.layers)), ("mtp_post", m)]
                self.layers.append(tl)
                self.mtp_of.append(m)
            else:
                steps.append(("mtp_whole", m))
        if not self.layers:
            raise ValueError("the model has no MoE layer: zebra's stages are cut at MoE layers")
        self.before: list[list[tuple]] = [[]]
        for step in steps:
            if step[0] == "moe":
                self.before.append([])
            else:
                self.before[-1].append(step)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _mtp_ids(self, m: int, batch: dict, ctx: "StageContext") -> tuple:
        """The tokens, positions (and padding mask, megatron-core 0.19) MTP layer m is given: the
        batch's rolled m times (its _get_embeddings rolls them once more)."""
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        ids, pos = batch["tokens"], batch["position_ids"]
        for layer in self.mtp[:m]:
            kw = dict(shifts=-1, dims=-1, cp_group=layer.cp_group, packed_seq_params=ctx.packed_seq_params)
            ids, pos = roll_tensor(ids, **kw)[0], roll_tensor(pos, **kw)[0]
        return ids, pos

    def _walk(self, steps: list[tuple], hidden: torch.Tensor, carry: tuple, batch: dict,
              ctx: "StageContext") -> tuple[torch.Tensor, tuple]:
        """Run `steps` on `hidden`: returns the hidden states the next cut reads and the carry."""
        for step in steps:
            kind = step[0]
            if kind == "dense":
                hidden, _ = step[1](hidden_states=hidden, **ctx.layer_kwargs())
            elif kind == "final_norm":
                final = self.gpt.decoder.final_layernorm
                if final is not None:
                    hidden = final(hidden)
                if self.mtp:  # the decoder's output: the head's first chunk, MTP layer 0's input
                    carry = (hidden,)
            elif kind == "mtp_pre":
                layer = self.mtp[step[1]]
                ids, pos = self._mtp_ids(step[1], batch, ctx)
                got = layer._get_embeddings(input_ids=ids, position_ids=pos, embedding=self.gpt.embedding,
                                            hidden_states=hidden, packed_seq_params=ctx.packed_seq_params)
                decoder_input, hidden = got[-2], got[-1]  # (ids, pos[, padding mask], input, hidden)
                hidden = layer._concat_embeddings(hidden, decoder_input)
            elif kind == "mtp_post":
                hidden = self.mtp[step[1]]._postprocess(hidden)
                carry = carry + (hidden,)
            else:  # "mtp_whole": a dense MTP layer runs as MultiTokenPredictionLayer.forward runs it
                ids, pos = self._mtp_ids(step[1], batch, ctx)
                hidden = self.mtp[step[1]](input_ids=ids, position_ids=pos, hidden_states=hidden,
                                           embedding=self.gpt.embedding, **ctx.layer_kwargs())[0]
                carry = carry + (hidden,)
        return hidden, carry

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

    def attention_and_route(self, layer: int, hidden: torch.Tensor, ctx: StageContext, batch: dict,
                            carry: tuple = ()):
        """The steps before MoE layer `layer`, then the layer up to dispatch: returns (DispatchMeta,
        permuted tokens, residual, routing probabilities in travel order, the shared experts'
        output or None, the carry). The shared experts run here, on the attention rank (Megatron's
        MoELayer computes them before the dispatch too); under zebra, other microbatches'
        transfers overlap them."""
        hidden, carry = self._walk(self.before[layer], hidden, carry, batch, ctx)
        tl = self.layers[layer]
        hidden, _ = tl._forward_attention(hidden, **ctx.layer_kwargs())
        pre = compat.pre_mlp_layernorm(tl, hidden)
        probs, routing_map = tl.mlp.route(pre)
        meta, permuted = tl.mlp.token_dispatcher.preprocess(pre, routing_map, probs)
        return meta, permuted, hidden, meta.probs, tl.mlp.shared_experts_compute(pre), carry

    def combine(self, layer: int, meta, combined: torch.Tensor, residual: torch.Tensor,
                probs: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer` after combine: unpermute with `probs`, add the shared experts' output
        (as MoELayer.postprocess), then bias-dropout-add onto the residual."""
        tl = self.layers[layer]
        out = tl.mlp.token_dispatcher.postprocess(meta, combined, probs)
        if shared is not None:
            out = out + shared
        return compat.mlp_bias_dropout_add(tl, (out, None), residual)

    def head(self, hidden: torch.Tensor, batch: dict, ctx: StageContext, carry: tuple = ()) -> torch.Tensor:
        """The last piece: the steps after the last MoE layer (dense layers, the final norm, what
        is left of the MTP block), then on the last pipeline stage the output layer
        (GPTModel._postprocess's logits or loss, over the decoder's and every MTP layer's output);
        on an earlier stage the hidden states that go to the next stage (_postprocess returns them)."""
        hidden, carry = self._walk(self.before[-1], hidden, carry, batch, ctx)
        if self.mtp:
            hidden = torch.cat(carry, dim=0)  # as MultiTokenPredictionBlock returns them
        return self.gpt._postprocess(hidden_states=hidden, input_ids=batch["tokens"],
                                     position_ids=batch["position_ids"], labels=batch["labels"],
                                     rotary_pos_emb=ctx.rotary_pos_emb, rotary_pos_cos=ctx.rotary_pos_cos,
                                     rotary_pos_sin=ctx.rotary_pos_sin, loss_mask=batch.get("loss_mask"),
                                     attention_mask=ctx.attention_mask, packed_seq_params=ctx.packed_seq_params,
                                     sequence_len_offset=ctx.sequence_len_offset)
