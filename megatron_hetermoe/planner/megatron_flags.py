"""The model of a Megatron-LM pretrain_gpt.py command line, for `hetermoe plan ... -- <flags>`, so
a plan is made for the model the run builds and the user never writes the shape twice.

Read, with Megatron-LM's (core_v0.16.1) defaults for the ones not given:
  --num-layers --hidden-size --num-attention-heads --num-experts (required)
  --ffn-hidden-size      default: int(8 h / 3 / 64) * 64 with --swiglu, else 4 h (arguments.py)
  --moe-ffn-hidden-size  default: --ffn-hidden-size
  --moe-router-topk 2, --moe-aux-loss-coeff 0.0, --moe-layer-freq 1,
  --moe-shared-expert-intermediate-size (default: none)
  --seq-length (or --encoder-seq-length), --global-batch-size: the search's --seq-len and
                         --global-batch when those are not given
  vocabulary: --padded-vocab-size as given (Megatron-LM takes it as is); else --vocab-size (with
              --tokenizer-type NullTokenizer: + 1 for EOD), padded as Megatron pads it
              (--make-vocab-size-divisible-by x --tensor-model-parallel-size); else ModelConfig's
              default (32000), padded, with a note. The planner reads no tokenizer files (it sits
              below data/): with another --tokenizer-type, give --padded-vocab-size.
Refused by name (`FLAG_REFUSALS`): flags that change the model in a way the cost model cannot price
(multi-token prediction layers, MLA, other MLP activations, per-layer configs, hybrid models,
a kv-channels width other than hidden/heads, expert latent projections).
Accepted with a note (`notes`), as the pricing differs a little from the run:
  --group-query-attention / --num-query-groups: priced as multi-head attention (K/V projections at
      full width: attention GEMMs overestimated by at most 2 h^2 of 8 h^2 per token);
  no --swiglu: priced as SwiGLU (the MLPs megatron_hetermoe.training.pretrain_gpt always builds;
      Megatron-LM's pretrain_gpt.py would build GeLU MLPs, 2/3 of the FLOPs);
  no --untie-embeddings-and-output-weights: priced untied (one V x h matrix more held).
--moe-shared-expert-gate (h parameters per layer) is not priced. Every other Megatron-LM flag
(parallel sizes, optimizer, data, checkpoints, routing options, HeterMoE's --hetero-* flags) does
not change what is priced and is ignored; a flag Megatron-LM does not have is an error (a typo).
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hetermoe.config import ModelConfig, ModelConfigError
from megatron_hetermoe.errors import UserError

# Megatron-LM core_v0.16.1's flag names (the list training/pretrain_gpt.py checks against too).
MEGATRON_FLAGS_FILE = Path(__file__).resolve().parent.parent / "training" / "megatron_lm_flags.txt"
DEFAULT_VOCAB = 32000  # ModelConfig's default (Mixtral's tokenizer)

# flag -> why a plan for it would not price the run's model
FLAG_REFUSALS = {
    "--multi-latent-attention": "multi-latent attention has other projections than the multi-head attention priced here",
    "--experimental-attention-variant": "an attention variant the cost model does not price",
    "--heterogeneous-layers-config-path": "per-layer configs give layers of other shapes than the model config's",
    "--heterogeneous-layers-config-encoded-json": "per-layer configs give layers of other shapes than the model config's",
    "--hybrid-override-pattern": "hybrid (Mamba) layers are not priced",
    "--is-hybrid-model": "hybrid (Mamba) layers are not priced",
    "--squared-relu": "the cost model prices SwiGLU MLPs (3 GEMMs), not squared-ReLU ones",
    "--use-fused-weighted-squared-relu": "the cost model prices SwiGLU MLPs (3 GEMMs), not squared-ReLU ones",
    "--quick-geglu": "the cost model prices SwiGLU MLPs, not GeGLU",
    "--moe-latent-size": "latent expert projections change the experts' shape",
}


class MegatronFlagsError(UserError, ValueError):
    """Megatron-LM flags that give no model this planner can price; the message names the flag."""


@dataclass
class FlagModel:
    """What the flags give: the model, the search defaults they imply and notes for the user."""

    model: ModelConfig
    seq_length: int | None = None
    global_batch_size: int | None = None
    notes: list[str] = field(default_factory=list)


def megatron_flag_names() -> frozenset[str]:
    return frozenset(line.strip() for line in MEGATRON_FLAGS_FILE.read_text().splitlines() if line.startswith("--"))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a bad value: the planner's one-line error, not this parser's usage
        raise MegatronFlagsError(f"after --: {message}")


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: Megatron's names only (--num-layers must not match --num-layers-per-...)
    p = _Parser(prog="hetermoe plan ... --", add_help=False, allow_abbrev=False)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--moe-ffn-hidden-size",
                 "--num-experts", "--moe-router-topk", "--seq-length", "--encoder-seq-length", "--vocab-size",
                 "--padded-vocab-size", "--global-batch-size", "--moe-shared-expert-intermediate-size",
                 "--kv-channels", "--num-query-groups", "--mtp-num-layers"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=None)
    p.add_argument("--moe-layer-freq", default=None)  # int or list expression: ModelConfig reads it
    for flag in ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--tokenizer-type", default=None)
    return p


def _check_flags(rest: list[str]) -> None:
    """Refuse the flags left over that change the model (FLAG_REFUSALS) or that Megatron-LM lacks."""
    names = list(dict.fromkeys(t.split("=", 1)[0] for t in rest if t.startswith("--")))
    refused = [f"{n} ({FLAG_REFUSALS[n]})" for n in names if n in FLAG_REFUSALS]
    if refused:
        raise MegatronFlagsError(f"refused Megatron-LM flag(s) after --: {'; '.join(refused)}; plan without them, "
                                 f"or give the model as --model CONFIG for the model you mean to price")
    known = megatron_flag_names()
    unknown = [n for n in names if n not in known and not n.startswith("--hetero-")]
    if unknown:
        raise MegatronFlagsError(f"flag(s) after -- that Megatron-LM core_v0.16.1 does not have: {' '.join(unknown)}; "
                                 f"after -- go pretrain_gpt.py's flags (hetermoe plan's own go before --)")


def padded_vocab_size(size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the tokenizer's vocab up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(size / multiple) * multiple)


def model_from_flags(argv: list[str], name: str = "pretrain_gpt-flags") -> FlagModel:
    """The model (and search defaults) a pretrain_gpt.py command line gives (module docstring)."""
    if "--model" in (t.split("=", 1)[0] for t in argv):
        raise MegatronFlagsError("--model after --: give the model either as --model CONFIG (before --) or as "
                                 "Megatron-LM flags after --, not both")
    a, rest = _parser().parse_known_args(argv)
    _check_flags(rest)
    missing = [f for f, v in (("--num-layers", a.num_layers), ("--hidden-size", a.hidden_size),
                              ("--num-attention-heads", a.num_attention_heads)) if v is None]
    if missing:
        raise MegatronFlagsError(f"the flags after -- give no model shape: add {' '.join(missing)}")
    if not a.num_experts:
        raise MegatronFlagsError("the flags after -- have no --num-experts: HeterMoE plans MoE models; add --num-experts N")
    notes: list[str] = []
    h, heads = a.hidden_size, a.num_attention_heads
    if a.kv_channels is not None and heads > 0 and a.kv_channels * heads != h:
        raise MegatronFlagsError(f"--kv-channels {a.kv_channels}: attention of width {a.kv_channels} x {heads} heads "
                                 f"!= --hidden-size {h} is not priced; drop it (Megatron's default: hidden / heads)")
    if a.group_query_attention or a.num_query_groups is not None:
        notes.append(f"--group-query-attention/--num-query-groups {a.num_query_groups}: priced as multi-head "
                     f"attention (K/V projections at full width; a slight overestimate)")
    if not a.swiglu:
        notes.append("no --swiglu: MLPs priced as SwiGLU (what megatron_hetermoe's pretrain_gpt builds; "
                     "Megatron-LM's pretrain_gpt.py without --swiglu builds GeLU MLPs)")
    if not a.untie_embeddings_and_output_weights:
        notes.append("no --untie-embeddings-and-output-weights: priced with untied embedding and output layer")
    ffn = a.ffn_hidden_size
    if ffn is None:  # Megatron-LM's rule (arguments.py)
        ffn = int((4 * h * 2 / 3) / 64) * 64 if a.swiglu else 4 * h
    coeff = a.moe_aux_loss_coeff
    if coeff is not None and len(coeff) != 1:
        raise MegatronFlagsError(f"--moe-aux-loss-coeff {' '.join(map(str, coeff))}: give one coefficient (one "
                                 f"load-balancing loss)")
    seq = a.seq_length if a.seq_length is not None else a.encoder_seq_length
    if a.padded_vocab_size is not None:
        vocab = a.padded_vocab_size
    else:
        if a.make_vocab_size_divisible_by < 1 or a.tensor_model_parallel_size < 1:
            raise MegatronFlagsError(f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by} and "
                                     f"--tensor-model-parallel-size {a.tensor_model_parallel_size} must be >= 1")
        if a.tokenizer_type not in (None, "NullTokenizer"):
            raise MegatronFlagsError(f"--tokenizer-type {a.tokenizer_type}: the planner does not read tokenizer files; "
                                     f"add --padded-vocab-size N after -- (the vocabulary the run pads the "
                                     f"tokenizer's to; Megatron-LM takes it as is)")
        if a.tokenizer_type == "NullTokenizer":  # ids 0..N-1 and EOD = N (Megatron's NullTokenizer)
            if a.vocab_size is None:
                raise MegatronFlagsError("--tokenizer-type NullTokenizer needs --vocab-size N")
            raw = a.vocab_size + 1
        elif a.vocab_size is not None:
            raw = a.vocab_size
        else:
            raw = DEFAULT_VOCAB
            notes.append(f"no --vocab-size, --padded-vocab-size or --tokenizer-type: priced with a vocabulary of "
                         f"{DEFAULT_VOCAB}, padded; give the run's to price its output layer")
        if raw < 1:
            raise MegatronFlagsError(f"--vocab-size {raw}: must be a positive integer")
        vocab = padded_vocab_size(raw, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)
    kw = dict(name=name, num_layers=a.num_layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn,
              moe_ffn_hidden_size=a.moe_ffn_hidden_size if a.moe_ffn_hidden_size is not None else ffn,
              num_experts=a.num_experts, moe_router_topk=a.moe_router_topk if a.moe_router_topk is not None else 2,
              moe_aux_loss_coeff=coeff[0] if coeff else 0.0, vocab_size=vocab,
              moe_layer_freq=a.moe_layer_freq if a.moe_layer_freq is not None else 1,
              moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
              mtp_num_layers=a.mtp_num_layers or None)
    if seq is not None:
        kw["seq_length"] = seq
    try:
        model = ModelConfig(**kw)
    except ModelConfigError as e:
        raise MegatronFlagsError(f"the flags after -- give no valid model: {_flag_names(str(e))}") from None
    return FlagModel(model, seq, a.global_batch_size, notes)


def _flag_names(msg: str) -> str:
    """A ModelConfig message in flag names (num_layers=3 -> --num-layers=3)."""
    fields = ("moe_shared_expert_intermediate_size", "moe_ffn_hidden_size", "ffn_hidden_size", "moe_layer_freq",
              "moe_router_topk", "moe_aux_loss_coeff", "num_attention_heads", "num_experts", "mtp_num_layers",
              "num_layers", "hidden_size", "vocab_size", "seq_length")
    # whole field names only (num_layers inside mtp_num_layers is not --num-layers)
    return re.sub(r"\b(" + "|".join(fields) + r")=", lambda m: f"--{m.group(1).replace('_', '-')}=", msg)
