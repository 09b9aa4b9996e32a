"""The parser of `hetermoe train`'s pretrain_gpt.py form (also `hetermoe train-gpt`): `hetermoe train`'s
flags with Megatron-LM pretrain_gpt.py's model-shape flags and defaults (behaviour: training/pretrain_gpt.py;
which form a command line is: cli/train_forms.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli import train
from megatron_hetermoe.cli.flags import FlagRows, add_flags

# What this trainer always builds and trains, as Megatron-LM flags: dest -> (flag, the value it
# must have (True: a switch), what Megatron-LM builds or trains without the flag).
RECIPE_FLAGS: dict[str, tuple[str, object, str]] = {
    "swiglu": ("--swiglu", True, "GeLU MLPs"),
    "normalization": ("--normalization", "RMSNorm", "LayerNorm"),
    "position_embedding_type": ("--position-embedding-type", "rope", "learned absolute position embeddings"),
    "disable_bias_linear": ("--disable-bias-linear", True, "biased linear layers"),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights", True,
                                            "tied input and output embeddings"),
    "hidden_dropout": ("--hidden-dropout", 0.0, "hidden dropout 0.1"),
    "attention_dropout": ("--attention-dropout", 0.0, "attention dropout 0.1"),
    "adam_beta2": ("--adam-beta2", 0.95, "Adam beta2 0.999"),
    "lr_decay_style": ("--lr-decay-style", "cosine", "linear LR decay"),
}


# Megatron-LM's model-shape, router and vocab flags, in --help order.
_SHAPE_FLAGS: FlagRows = (
    ("--num-layers", dict(type=int, default=None), "transformer layers (default: --model's)"),
    ("--hidden-size", dict(type=int, default=None), "model width (default: --model's)"),
    ("--num-attention-heads", dict(type=int, default=None),
     "attention heads; hidden size / heads must be even (default: --model's)"),
    ("--ffn-hidden-size", dict(type=int, default=None), "default: 4 x hidden size (Megatron's)"),
    ("--moe-ffn-hidden-size", dict(type=int, default=None), "per-expert size; default: --ffn-hidden-size"),
    ("--num-experts", dict(type=int, default=None), "experts per MoE layer (default: --model's)"),
    ("--moe-router-topk", dict(type=int, default=None), "default: 2 (Megatron's)"),
    ("--moe-router-load-balancing-type", dict(
        nargs="+", default=None, choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]),
     "router load balancing, one of aux_loss, seq_aux_loss, none (aux-loss-free: none with "
     "--moe-router-enable-expert-bias); global_aux_loss, sinkhorn and combinations are refused "
     "(default: --model's, else Megatron's aux_loss)"),
    ("--moe-router-score-function", dict(choices=["softmax", "sigmoid"], default=None),
     "router scores (default: --model's, else Megatron's softmax)"),
    ("--moe-router-enable-expert-bias", dict(action="store_true", default=None),
     "aux-loss-free balancing: a per-expert bias on the scores for the top-k choice, updated "
     "after every step from the token counts of every routing rank (sigmoid scores only)"),
    ("--moe-router-bias-update-rate", dict(type=float, default=None),
     "the expert bias's step per update (default: --model's, else Megatron's 1e-3)"),
    ("--max-position-embeddings", dict(type=int, default=None),
     "must be >= --seq-length (RoPE: no learned table; default: --seq-length)"),
    ("--vocab-size", dict(type=int, default=None),
     "NullTokenizer's vocab before EOD; without --tokenizer-type, mock data's vocab "
     "(default: --model's, else the tokenizer's)"),
    ("--make-vocab-size-divisible-by", dict(type=int, default=128),
     "pad the vocab to a multiple of this x TP, as Megatron does"),
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's model-shape and related flags that `hetermoe train` takes from a model YAML."""
    g = p.add_argument_group("model (Megatron-LM flags)")
    add_flags(g, _SHAPE_FLAGS)
    req = "required: the model is always Mixtral-style"
    g.add_argument("--normalization", choices=["RMSNorm"], default=None, help=f"only RMSNorm ({req})")
    g.add_argument("--position-embedding-type", choices=["rope"], default=None, help=f"only rope ({req})")
    for dest in ("swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights"):
        flag, _, instead = RECIPE_FLAGS[dest]
        g.add_argument(flag, dest=dest, action="store_true", help=f"{req}; Megatron-LM builds {instead} without it")
    for dest in ("hidden_dropout", "attention_dropout"):
        g.add_argument(RECIPE_FLAGS[dest][0], dest=dest, type=float, choices=[0.0], default=None,
                       help="only 0 (required: the model has no dropout; Megatron-LM's default is 0.1)")
    g = p.add_argument_group("schedule and evaluation (Megatron-LM flags)")
    g.add_argument("--adam-beta2", type=float, choices=[0.95], default=None,
                   help="only 0.95 (required: Megatron-LM's default is 0.999)")
    g.add_argument("--lr-decay-style", choices=["cosine"], default=None,
                   help="LR decay after warm-up: only cosine (required: Megatron-LM's default is linear)")
    g.add_argument("--eval-iters", type=int, default=None,
                   help="only 0: evaluation is not implemented (default: not set; Megatron-LM's is 100)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="only with --eval-iters 0, where it has no effect (default: not set)")


def _set_help(p: argparse.ArgumentParser, dest: str, text: str) -> None:
    next(a for a in p._actions if a.dest == dest).help = text


def build_parser(description: str, progress_timeout_s: float,
                 prog: str = "python -m megatron_hetermoe.training.pretrain_gpt") -> argparse.ArgumentParser:
    """`hetermoe train`'s parser (cli/train.py) with Megatron-LM's model-shape flags and defaults."""
    p = train.build_parser(progress_timeout_s, prog=prog)
    p.description = description
    p.allow_abbrev = False  # Megatron's names only: "--lr-decay" must not silently mean something
    p.set_defaults(model=None)  # the shape comes from the flags (or a --model YAML to start from)
    add_model_args(p)
    # Megatron-LM's defaults where `hetermoe train`'s differ: min LR 0; no fixed global batch.
    p.set_defaults(min_lr=0.0, global_batch_size=None)
    _set_help(p, "global_batch_size", "sequences per step; a multiple of --micro-batch-size x data-parallel size "
              "(required: Megatron-LM's default, micro batch x data-parallel size, is not taken here)")
    return p
