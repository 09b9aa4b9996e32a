"""The model and the run of a Megatron-LM pretrain_gpt.py command line, for `hetermoe plan ... --
<flags>`, so a plan is made for the model the run builds and the layout and batch it runs, and the
user never writes them twice.

The model (`FlagModel.model`, a ModelConfig), with Megatron-LM's (core_v0.16.1) meaning and default
for every flag that changes what megatron-core builds:
  --num-layers --hidden-size --num-attention-heads --num-experts (required)
  --ffn-hidden-size      default: int(8 h / 3 / 64) * 64 with --swiglu, else 4 h (arguments.py)
  --moe-ffn-hidden-size  default: --ffn-hidden-size
  --moe-router-topk 2, --moe-aux-loss-coeff 0.0, --moe-layer-freq 1, --moe-shared-expert-intermediate-size
      (none), --moe-shared-expert-gate, --moe-router-num-groups / --moe-router-group-topk, --mtp-num-layers
  attention: --kv-channels (default hidden / heads), --num-query-groups (only with --group-query-attention,
      as core_transformer_config_from_args reads it; else one group per head), --qk-layernorm,
      --attention-output-gate, --softmax-type, --window-size / --window-attn-skip-freq,
      --multi-latent-attention with --q-lora-rank (none) --kv-lora-rank 32 --qk-head-dim 128
      --qk-pos-emb-head-dim 64 --v-head-dim 128
  MLPs and the rest: --swiglu / --quick-geglu / --squared-relu (default GeLU), --normalization (LayerNorm),
      --disable-bias-linear (default: biases), --add-qkv-bias, --untie-embeddings-and-output-weights (default
      tied), --position-embedding-type (learned_absolute, with --max-position-embeddings)
  --seq-length (or --encoder-seq-length), --global-batch-size: the search's --seq-len and
                         --global-batch when those are not given
  vocabulary: --padded-vocab-size as given (Megatron-LM takes it as is); else --vocab-size (with
              --tokenizer-type NullTokenizer: + 1 for EOD), padded as Megatron pads it
              (--make-vocab-size-divisible-by x --tensor-model-parallel-size); else ModelConfig's
              default (32000), padded, with a note. The planner reads no tokenizer files (it sits
              below data/): with another --tokenizer-type, give --padded-vocab-size.
The run (`FlagModel.run`, a RunFlags), as Megatron-LM's validate_args reads it: --tensor-model-parallel-size,
--context-parallel-size (the plan's attention_cp), --pipeline-model-parallel-size, the virtual pipeline
size (--num-virtual-stages-per-pipeline-rank, or --num-layers-per-virtual-pipeline-stage as layers per
stage / that), --expert-model-parallel-size,
--micro-batch-size (default 1), --global-batch-size (default: micro batch x data-parallel size),
--sequence-parallel, --use-distributed-optimizer and recomputation (--recompute-activations is
--recompute-granularity selective; --moe-layer-recompute adds the module "moe", and Megatron refuses it
with full granularity).
Refused by name (`FLAG_REFUSALS`): flags that give a model or layout a plan cannot describe (per-layer
configs, hybrid and linear-attention models, experimental attention variants, expert latent
projections, custom and uneven pipeline layouts). Every other Megatron-LM flag (optimizer, data,
checkpoints, routing functions, fusions, HeterMoE's --hetero-* flags) does not change what is priced
and is ignored; a flag Megatron-LM does not have is an error (a typo).
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

# flag -> why a plan made from it would not describe the run
FLAG_REFUSALS = {
    "--experimental-attention-variant": "an attention variant (DeepSeek sparse attention, ...) the cost model does "
                                        "not price and the runtime refuses",
    "--heterogeneous-layers-config-path": "per-layer configs give layers of other shapes than one model config's",
    "--heterogeneous-layers-config-encoded-json": "per-layer configs give layers of other shapes than one model "
                                                  "config's",
    "--hybrid-override-pattern": "hybrid (Mamba) layers are not priced",
    "--is-hybrid-model": "hybrid (Mamba) layers are not priced",
    "--linear-attention-freq": "linear-attention layers are not priced",
    "--moe-latent-size": "latent expert projections change the experts' shape",
    "--pipeline-model-parallel-layout": "a custom pipeline layout: a plan splits the decoder layers evenly "
                                        "(Megatron's default split); the runtime refuses it too",
    "--account-for-embedding-in-pipeline-split": "a plan splits the decoder layers evenly (Megatron's default "
                                                 "split); the runtime refuses it too",
    "--account-for-loss-in-pipeline-split": "a plan splits the decoder layers evenly (Megatron's default split); "
                                            "the runtime refuses it too",
}
# Megatron's --recompute-modules choices (TransformerConfig.recompute_modules)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


class MegatronFlagsError(UserError, ValueError):
    """Megatron-LM flags that give no model or run this planner can describe; the message names the flag."""


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recomputation as validate_args and TransformerConfig settle it:
    `granularity` None, "full" or "selective"; `modules` the selective ones ("moe": the whole MoE
    layer, which --moe-layer-recompute adds); `method` and `num_layers` of full recomputation."""
    granularity: str | None = None
    modules: tuple[str, ...] = ()
    method: str | None = None
    num_layers: int | None = None

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    @property
    def moe_layer(self) -> bool:
        """The MoE layer recomputed whole (its dispatch replayed): expert ranks keep nothing for backward."""
        return self.granularity == "selective" and "moe" in self.modules

    @property
    def selective(self) -> frozenset[str]:
        """The selective modules other than the MoE layer."""
        return frozenset(self.modules) - {"moe"} if self.granularity == "selective" else frozenset()

    def describe(self) -> str:
        if self.granularity is None:
            return "no recomputation"
        if self.full:
            return f"full recomputation ({self.method or 'uniform'})"
        return f"selective recomputation of {', '.join(self.modules)}"


@dataclass(frozen=True)
class RunFlags:
    """The layout and batch of the run, as Megatron-LM reads its flags (module docstring);
    `given`: the flag names the command line gives (a default is not a choice)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_stages: int = 1  # Megatron's virtual_pipeline_model_parallel_size, 1 for None
    expert_model_parallel_size: int = 1
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: Megatron's default, micro batch x data-parallel size
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: Recompute = field(default_factory=Recompute)
    given: frozenset[str] = frozenset()
    # --decoder-first/last-pipeline-num-layers: an uneven pipeline split (None: Megatron's even one)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    context_parallel_size: int = 1  # --context-parallel-size: the attention members' CP size (plan.attention_cp)


@dataclass
class FlagModel:
    """What the flags give: the model, the run, the search defaults they imply and notes for the user."""

    model: ModelConfig
    seq_length: int | None = None
    global_batch_size: int | None = None
    notes: list[str] = field(default_factory=list)
    run: RunFlags = field(default_factory=RunFlags)


def megatron_flag_names() -> frozenset[str]:
    return frozenset(line.strip() for line in MEGATRON_FLAGS_FILE.read_text().splitlines() if line.startswith("--"))


def _refuse(message: str):
    """A bad value: the planner's one-line error, not the parser's usage."""
    raise MegatronFlagsError(f"after --: {message}")


def _parser() -> argparse.ArgumentParser:
    from megatron_hetermoe.cli.plan import megatron_flags_parser

    return megatron_flags_parser(RECOMPUTE_MODULES, _refuse)


def _check_flags(rest: list[str], megatron_parsed: bool = False) -> None:
    """Refuse the flags left over that change the model or layout (FLAG_REFUSALS) or that Megatron-LM lacks
    (not checked where Megatron-LM's own parser has read the line: its release may have newer flags)."""
    names = list(dict.fromkeys(t.split("=", 1)[0] for t in rest if t.startswith("--")))
    refused = [f"{n} ({FLAG_REFUSALS[n]})" for n in names if n in FLAG_REFUSALS]
    if refused:
        raise MegatronFlagsError(f"refused Megatron-LM flag(s) after --: {'; '.join(refused)}; plan without them, "
                                 f"or give the model as --model CONFIG for the model you mean to price")
    known = megatron_flag_names()
    unknown = [n for n in names if n not in known and not n.startswith("--hetero-") and not megatron_parsed]
    if unknown:
        raise MegatronFlagsError(f"flag(s) after -- that Megatron-LM core_v0.16.1 does not have: {' '.join(unknown)}; "
                                 f"after -- go pretrain_gpt.py's flags (hetermoe plan's own go before --)")


def padded_vocab_size(size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the tokenizer's vocab up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(size / multiple) * multiple)


def _activation(a: argparse.Namespace) -> str:
    """core_transformer_config_from_args: --swiglu is gated SiLU; --squared-relu and --quick-geglu
    each assert it is not given with --swiglu; otherwise GeLU."""
    given = [f for f, on in (("--swiglu", a.swiglu), ("--quick-geglu", a.quick_geglu),
                             ("--squared-relu", a.squared_relu)) if on]
    if len(given) > 1:
        raise MegatronFlagsError(f"{' and '.join(given)} after --: Megatron-LM takes one MLP activation; keep one")
    return {"--swiglu": "swiglu", "--quick-geglu": "quick-geglu", "--squared-relu": "squared-relu"}.get(
        given[0] if given else "", "gelu")


def _virtual_stages(a: argparse.Namespace) -> int:
    """Megatron-LM validate_args' virtual pipeline size (1 for its None)."""
    per_stage, stages = a.num_layers_per_virtual_pipeline_stage, a.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and stages is not None:
        raise MegatronFlagsError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                                 "after --: Megatron-LM takes at most one; keep one")
    if stages is not None:
        if stages < 1:
            raise MegatronFlagsError(f"--num-virtual-stages-per-pipeline-rank {stages}: must be >= 1")
        return stages
    if per_stage is None:
        return 1
    pp = a.pipeline_model_parallel_size
    if per_stage < 1 or a.num_layers % pp or (a.num_layers // pp) % per_stage:
        raise MegatronFlagsError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: must divide the {a.num_layers} "
                                 f"layers / --pipeline-model-parallel-size {pp} (Megatron-LM's rule)")
    return a.num_layers // pp // per_stage


def _recompute(a: argparse.Namespace) -> Recompute:
    """validate_args (--recompute-activations is selective) and TransformerConfig (selective modules
    default to core_attn; --moe-layer-recompute adds "moe" and is refused with full granularity)."""
    granularity = "selective" if a.recompute_activations else a.recompute_granularity
    if a.moe_layer_recompute:
        if granularity == "full":
            raise MegatronFlagsError("--moe-layer-recompute with --recompute-granularity full after --: Megatron "
                                     "refuses it (\"Do not set --moe-layer-recompute with full recompute "
                                     "granularity\"); keep one")
        granularity = "selective"
    modules: tuple[str, ...] = ()
    if granularity == "selective":
        modules = tuple(a.recompute_modules if a.recompute_modules is not None else ["core_attn"])
        if a.moe_layer_recompute and "moe" not in modules:
            modules += ("moe",)
    return Recompute(granularity, modules, a.recompute_method if granularity == "full" else None,
                     a.recompute_num_layers if granularity == "full" else None)


def _run(a: argparse.Namespace, given: frozenset[str]) -> RunFlags:
    for flag, v in (("--tensor-model-parallel-size", a.tensor_model_parallel_size),
                    ("--pipeline-model-parallel-size", a.pipeline_model_parallel_size),
                    ("--context-parallel-size", a.context_parallel_size),
                    ("--expert-model-parallel-size", a.expert_model_parallel_size),
                    ("--micro-batch-size", a.micro_batch_size)):
        if v < 1:
            raise MegatronFlagsError(f"{flag} {v} after --: must be >= 1")
    if a.global_batch_size is not None and a.global_batch_size < 1:
        raise MegatronFlagsError(f"--global-batch-size {a.global_batch_size} after --: must be >= 1")
    return RunFlags(a.tensor_model_parallel_size, a.pipeline_model_parallel_size, _virtual_stages(a),
                    a.expert_model_parallel_size, a.micro_batch_size, a.global_batch_size,
                    a.sequence_parallel and a.tensor_model_parallel_size > 1, a.use_distributed_optimizer,
                    _recompute(a), given, a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers,
                    context_parallel_size=a.context_parallel_size)


def _vocab(a: argparse.Namespace, notes: list[str]) -> int:
    if a.padded_vocab_size is not None:
        return a.padded_vocab_size
    if a.make_vocab_size_divisible_by < 1:
        raise MegatronFlagsError(f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by} must be >= 1")
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
    return padded_vocab_size(raw, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)


def model_from_flags(argv: list[str], name: str = "pretrain_gpt-flags", megatron_parsed: bool = False) -> FlagModel:
    """The model, the run and the search defaults a pretrain_gpt.py command line gives (module docstring);
    `megatron_parsed`: Megatron-LM's parser has accepted the line (--hetero-plan auto in pretrain())."""
    if "--model" in (t.split("=", 1)[0] for t in argv):
        raise MegatronFlagsError("--model after --: give the model either as --model CONFIG (before --) or as "
                                 "Megatron-LM flags after --, not both")
    a, rest = _parser().parse_known_args(argv)
    _check_flags(rest, megatron_parsed)
    missing = [f for f, v in (("--num-layers", a.num_layers), ("--hidden-size", a.hidden_size),
                              ("--num-attention-heads", a.num_attention_heads)) if v is None]
    if missing:
        raise MegatronFlagsError(f"the flags after -- give no model shape: add {' '.join(missing)}")
    if not a.num_experts:
        raise MegatronFlagsError("the flags after -- have no --num-experts: HeterMoE plans MoE models; add "
                                 "--num-experts N")
    given = frozenset(t.split("=", 1)[0] for t in argv if t.startswith("--"))
    notes: list[str] = []
    h = a.hidden_size
    activation = _activation(a)
    ffn = a.ffn_hidden_size
    if ffn is None:  # Megatron-LM's rule (arguments.py)
        ffn = int((4 * h * 2 / 3) / 64) * 64 if a.swiglu else 4 * h
    coeff = a.moe_aux_loss_coeff
    if coeff is not None and len(coeff) != 1:
        raise MegatronFlagsError(f"--moe-aux-loss-coeff {' '.join(map(str, coeff))}: give one coefficient (one "
                                 f"load-balancing loss)")
    if a.position_embedding_type in ("mrope", "relative"):
        raise MegatronFlagsError(f"--position-embedding-type {a.position_embedding_type}: a GPT model of Megatron-LM "
                                 f"takes learned_absolute, rope or none; use one of them")
    if a.multi_latent_attention and a.group_query_attention:
        raise MegatronFlagsError("--multi-latent-attention with --group-query-attention: Megatron-LM refuses the pair "
                                 "(\"Group query attention is mutually exclusive with multi latent attention\")")
    if a.window_size is not None and len(a.window_size) != 2:
        raise MegatronFlagsError(f"--window-size {','.join(map(str, a.window_size))}: give two integers (left, right), "
                                 f"e.g. 128,0")
    seq = a.seq_length if a.seq_length is not None else a.encoder_seq_length
    run = _run(a, given)
    kw = dict(name=name, num_layers=a.num_layers, hidden_size=h, num_attention_heads=a.num_attention_heads,
              ffn_hidden_size=ffn,
              moe_ffn_hidden_size=a.moe_ffn_hidden_size if a.moe_ffn_hidden_size is not None else ffn,
              num_experts=a.num_experts, moe_router_topk=a.moe_router_topk if a.moe_router_topk is not None else 2,
              moe_aux_loss_coeff=coeff[0] if coeff else 0.0, vocab_size=_vocab(a, notes),
              moe_layer_freq=a.moe_layer_freq if a.moe_layer_freq is not None else 1,
              moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
              mtp_num_layers=a.mtp_num_layers or None, kv_channels=a.kv_channels,
              # core_transformer_config_from_args: groups only with --group-query-attention
              num_query_groups=a.num_query_groups if a.group_query_attention else None,
              qk_layernorm=a.qk_layernorm, attention_output_gate=a.attention_output_gate, softmax_type=a.softmax_type,
              window_size=a.window_size, window_attn_skip_freq=a.window_attn_skip_freq,
              multi_latent_attention=a.multi_latent_attention, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
              qk_head_dim=a.qk_head_dim, qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
              mlp_activation=activation, normalization=a.normalization, add_bias_linear=a.add_bias_linear,
              add_qkv_bias=a.add_qkv_bias, moe_shared_expert_gate=a.moe_shared_expert_gate,
              moe_router_num_groups=a.moe_router_num_groups, moe_router_group_topk=a.moe_router_group_topk,
              untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
              position_embedding_type=a.position_embedding_type,
              # the position table's size: it describes the model only with learned absolute positions
              max_position_embeddings=a.max_position_embeddings if a.position_embedding_type == "learned_absolute"
              else None)
    if a.multi_latent_attention and a.kv_channels is not None:
        kw["kv_channels"] = None  # MLA's heads are qk_head_dim + qk_pos_emb_head_dim and v_head_dim wide
    if seq is not None:
        kw["seq_length"] = seq
    try:
        model = ModelConfig(**kw)
    except ModelConfigError as e:
        raise MegatronFlagsError(f"the flags after -- give no valid model: {_flag_names(str(e))}") from None
    return FlagModel(model, seq, a.global_batch_size, notes, run)


def _flag_names(msg: str) -> str:
    """A ModelConfig message in flag names (num_layers=3 -> --num-layers=3)."""
    fields = ("moe_shared_expert_intermediate_size", "moe_ffn_hidden_size", "ffn_hidden_size", "moe_layer_freq",
              "moe_router_topk", "moe_aux_loss_coeff", "num_attention_heads", "num_experts", "mtp_num_layers",
              "num_layers", "hidden_size", "vocab_size", "seq_length", "kv_channels", "num_query_groups",
              "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "moe_router_num_groups", "moe_router_group_topk", "window_attn_skip_freq", "window_size",
              "max_position_embeddings")
    # whole field names only (num_layers inside mtp_num_layers is not --num-layers)
    return re.sub(r"\b(" + "|".join(fields) + r")=", lambda m: f"--{m.group(1).replace('_', '-')}=", msg)
