"""Megatron-LM's pretrain_gpt.py command line, for the subset this plugin trains: `hetermoe train`'s
pretrain_gpt.py form (`hetermoe train-gpt`, its alias, and this module's main take it whatever the flags).

    hetermoe train --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --ffn-hidden-size 128 --num-experts 4 --moe-router-topk 2 \
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 \
        --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
        --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 \
        --adam-beta2 0.95 --lr-decay-style cosine \
        --lr 1e-3 --train-iters 20 --data-path data/python-docs_text_document \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/tokenizer/tokenizer.json \
        --hetero-plan plan.json

Flags keep Megatron-LM's names and meanings (model shape, MoE, parallel sizes, batch, optimizer,
data, tokenizer, checkpoints). The model is always Mixtral-style (every layer MoE, SwiGLU,
RMSNorm, RoPE, no bias, untied embeddings, no dropout), trained with Adam beta2 0.95 and cosine
LR decay: the flags that make Megatron-LM build and train that (RECIPE_FLAGS) are required, and a
command line without one is refused by name, since Megatron-LM would build or train something
else from it (GeLU MLPs, LayerNorm, ...); `hetermoe pretrain` (Megatron's own pretrain()) builds
whatever the flags say. Likewise refused: no --global-batch-size (Megatron-LM's default is
micro batch x data-parallel size), --eval-interval without --eval-iters 0, --moe-router-topk 1,
and (in `hetermoe train`'s validation, for both) --recompute-granularity full outside the zebra
schedule. --min-lr defaults to Megatron-LM's 0.
The vocabulary is the tokenizer's, padded as Megatron pads it. --transformer-impl and
--moe-grouped-gemm keep Megatron-LM's meaning when given (a request that cannot run here, e.g.
transformer_engine without transformer-engine or on CPU ranks, is refused); without them the
kernels are chosen for the ranks' device and printed (models.builder.choose_kernels), where
Megatron-LM would default to transformer_engine.
A flag that Megatron-LM has but this trainer does not is refused by name
(from megatron_lm_flags.txt, Megatron-LM core_v0.16.1's own parser), as is a flag neither has.
The run itself is `hetermoe train` (train_args.run_from_args), with this model shape.

`hetermoe train` takes this form when its command line has a flag only this form takes (any of
cli/train_gpt.add_model_args', e.g. --num-layers or --swiglu), with or without --model, and otherwise
its config form (training/command.py). `hetermoe train-gpt` and `python -m
megatron_hetermoe.training.pretrain_gpt` run this form for any command line.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import yaml

from megatron_hetermoe.cli import train_gpt as train_gpt_cli
from megatron_hetermoe.cli.train_gpt import RECIPE_FLAGS
from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.errors import UserError
from megatron_hetermoe.parallel.watchdog import DEFAULT_PROGRESS_TIMEOUT_S
from megatron_hetermoe.training import args as train_args

MEGATRON_FLAGS_FILE = Path(__file__).with_name("megatron_lm_flags.txt")
MEGATRON_REF = "core_v0.16.1"

# Flags this entry point takes that Megatron-LM does not have: HeterMoE's own, and the launcher's.
EXTENSION_FLAGS = frozenset({
    "--model", "--nproc", "--progress-timeout", "--golden-values-out", "--timeline-dir",
    "--hetero-plan", "--hetero-schedule", "--hetero-ckpt-reshard", "--hetero-expert-precision",
    "--hetero-zebra-issuer", "--hetero-expert-load-stats", "--hetero-gpus", "--elastic-restarts",
    "--hetero-replan-interval", "--hetero-replan-margin",
    "--emulate", "--emulated-model", "--emulated-seq-length", "--emulated-global-batch-size", "--emulation-scale",
    # Megatron-LM has only --no-check-for-nan-in-loss-and-grad; the positive form takes stop/skip here.
    "--check-for-nan-in-loss-and-grad",
})

MEGATRON_PRETRAIN = ("`hetermoe pretrain` (Megatron's own pretrain(), which builds what the flags say; needs "
                     "megatron-core >= 0.19, or a Megatron-LM checkout in MEGATRON_LM_DIR)")


def _recipe_flag(flag: str, value: object) -> list[str]:
    return [flag] if value is True else [flag, f"{value:g}" if isinstance(value, float) else str(value)]


def recipe_args() -> list[str]:
    """RECIPE_FLAGS as a command line."""
    return [t for flag, value, _ in RECIPE_FLAGS.values() for t in _recipe_flag(flag, value)]


SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_experts", "seq_length")


def megatron_flags() -> frozenset[str]:
    """Megatron-LM's flag names (committed list; remake with scripts/megatron_flags.py)."""
    return frozenset(line.strip() for line in MEGATRON_FLAGS_FILE.read_text().splitlines() if line.startswith("--"))


PROG = "python -m megatron_hetermoe.training.pretrain_gpt"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """This form's parser (cli/train_gpt.py), described by this module's first paragraph."""
    return train_gpt_cli.build_parser(__doc__.split("\n\n")[0], DEFAULT_PROGRESS_TIMEOUT_S, prog)


def reject_unknown(p: argparse.ArgumentParser, rest: list[str]) -> None:
    """Name each flag left over: a Megatron-LM flag not supported here, or no flag at all."""
    names = [t.split("=", 1)[0] for t in rest if t.startswith("-")]
    if not names and rest:
        p.error(f"unexpected argument(s): {' '.join(rest)}")
    known = megatron_flags()
    unsupported = [n for n in names if n in known]
    unknown = [n for n in names if n not in known]
    msgs = []
    if unsupported:
        msgs.append(f"unsupported Megatron-LM flag(s): {' '.join(unsupported)} (Megatron-LM {MEGATRON_REF} has "
                    f"them, this trainer does not; drop them, see --help for the supported subset)")
    if unknown:
        msgs.append(f"unknown flag(s): {' '.join(unknown)} (neither this trainer's nor Megatron-LM {MEGATRON_REF}'s)")
    if msgs:
        p.error("; ".join(msgs))


def padded_vocab_size(size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the tokenizer's vocab up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(size / multiple) * multiple)


def model_from_args(a: argparse.Namespace) -> ModelConfig:
    """The ModelConfig these flags describe (starting from --model's YAML when given)."""
    base = asdict(ModelConfig.load(a.model)) if a.model else {"name": "pretrain_gpt", "moe_aux_loss_coeff": 0.0}
    given = {f: getattr(a, f) for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                         "moe_ffn_hidden_size", "num_experts", "moe_router_topk", "seq_length",
                                         "moe_aux_loss_coeff", "moe_router_score_function",
                                         "moe_router_enable_expert_bias", "moe_router_bias_update_rate")
             if getattr(a, f) is not None}
    lb = getattr(a, "moe_router_load_balancing_type", None)
    if lb is not None:
        if len(lb) != 1:  # Megatron sums the losses of a list of types, each with its own coefficient
            raise ValueError(f"--moe-router-load-balancing-type {' '.join(lb)}: combined load-balancing types are not "
                             f"supported here; give one")
        given["moe_router_load_balancing_type"] = lb[0]
    m = {**base, **given}
    missing = [f for f in SHAPE_FIELDS if f not in m]
    if missing:
        raise ValueError("model shape incomplete: give " + " ".join("--" + f.replace("_", "-") for f in missing)
                         + " (or --model NAME for a YAML in configs/models to start from)")
    # Megatron-LM's default: with --swiglu 2/3 of 4h rounded down to a multiple of 64 (the same
    # parameter count as a 4h GeLU MLP), else 4h.
    h = m["hidden_size"]
    m.setdefault("ffn_hidden_size", int(4 * h * 2 / 3 / 64) * 64 if getattr(a, "swiglu", False) else 4 * h)
    m.setdefault("moe_ffn_hidden_size", m["ffn_hidden_size"])
    m.setdefault("moe_router_topk", 2)
    if a.max_position_embeddings is not None and a.max_position_embeddings < m["seq_length"]:
        raise ValueError(f"--max-position-embeddings {a.max_position_embeddings} < --seq-length {m['seq_length']}; "
                         f"raise it to at least {m['seq_length']}")
    if a.vocab_size is not None and a.vocab_size < 1:  # before padding turns -5 into 0
        raise ValueError(f"--vocab-size {a.vocab_size}: must be a positive integer (the vocabulary before "
                         f"Megatron's padding to a multiple of --make-vocab-size-divisible-by)")
    if a.make_vocab_size_divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by}: must be a positive "
                         f"integer (Megatron's default is 128)")
    if a.tokenizer_type:
        from megatron_hetermoe.data.tokenizer import build_tokenizer

        tok = build_tokenizer(a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file, a.vocab_size)
        m["vocab_size"] = padded_vocab_size(tok.vocab_size, a.make_vocab_size_divisible_by,
                                            a.tensor_model_parallel_size)
    elif a.vocab_size is not None:
        m["vocab_size"] = padded_vocab_size(a.vocab_size, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)
    elif "vocab_size" not in m:
        raise ValueError("no vocabulary: give --tokenizer-type (with its files), or --vocab-size N for mock data")
    return ModelConfig(**m)


def check_supported(a: argparse.Namespace) -> None:
    """Refuse what this trainer cannot do, and every command line from which Megatron-LM would build
    or train something other than what this trainer does."""
    missing = [f"{' '.join(_recipe_flag(flag, value))} (without it: {instead})"
               for dest, (flag, value, instead) in RECIPE_FLAGS.items()
               if getattr(a, dest) is None or getattr(a, dest) is False]  # not `in (None, False)`: 0.0 == False
    if missing:
        raise ValueError(
            "this trainer always builds a Mixtral-style model (SwiGLU, RMSNorm, RoPE, no bias, untied embeddings, "
            "no dropout) and trains it with Adam beta2 0.95 and cosine LR decay; Megatron-LM does that only with "
            f"these flags, missing here: {', '.join(missing)}. Add them, or run {MEGATRON_PRETRAIN}")
    if a.global_batch_size is None:
        raise ValueError("--global-batch-size not given: Megatron-LM would take --micro-batch-size x the data-parallel "
                         "size, this trainer takes no default; give --global-batch-size N")
    if a.eval_iters not in (None, 0):
        raise ValueError(f"--eval-iters {a.eval_iters}: evaluation is not implemented here; pass --eval-iters 0")
    if a.eval_interval is not None and a.eval_iters is None:
        raise ValueError(f"--eval-interval {a.eval_interval} without --eval-iters: Megatron-LM would evaluate (its "
                         f"--eval-iters default is 100), this trainer does not; pass --eval-iters 0, or run "
                         f"{MEGATRON_PRETRAIN}")
    if a.moe_router_topk == 1:
        raise ValueError("--moe-router-topk 1: this trainer routes top-1 with the softmax before top-k (Megatron-LM's "
                         "--moe-router-pre-softmax, not taken here; Megatron-LM refuses top-1 without it); use "
                         f"--moe-router-topk 2 or more, or run {MEGATRON_PRETRAIN}")


class FlagError(UserError, ValueError):
    """A pretrain_gpt flag refused by check_flags (the message is the parser's)."""


@contextmanager
def _parsed(p: argparse.ArgumentParser, argv: list[str] | None):
    """The flags, parsed and checked, with the model shape they give written to a YAML file for
    the block's lifetime (the trainer and its ranks read the model from a path)."""
    a, rest = p.parse_known_args(argv)
    reject_unknown(p, rest)
    try:
        check_supported(a)
        model = model_from_args(a)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    with tempfile.TemporaryDirectory(prefix="pretrain_gpt_") as tmp:
        path = Path(tmp) / f"{model.name}.yaml"
        path.write_text(yaml.safe_dump(asdict(model), sort_keys=False))
        a.model = str(path)
        a.seq_length = model.seq_length
        yield a


def check_flags(argv: list[str]) -> None:
    """Everything main(argv) checks before it starts ranks, without starting any and without
    touching the paths the run would write; FlagError names the first bad flag. The SLURM
    renderer runs it on a job's flags before writing the job script."""
    p = build_parser()

    def error(message: str):
        raise FlagError(message)

    p.error = error  # the parser's own checks and ours raise instead of exiting
    with _parsed(p, argv) as a:
        train_args.validate_run(p, a, check_outputs=False)


def main(argv: list[str] | None = None, prog: str = PROG, chosen_by: str | None = None) -> int:
    """Run this form: `hetermoe train-gpt`, or `hetermoe train` when `chosen_by` (the flag that picked
    this form) is given; then a refusal of the form's own checks says why the line was read this way."""
    p = build_parser(prog)
    refuse = p.error
    if chosen_by is not None:
        def error(message: str):
            refuse(f"{message} [{prog} read these as Megatron-LM pretrain_gpt.py flags: {chosen_by} is one only "
                   f"that form takes; without any, it takes the model from --model (default tiny) with its own "
                   f"defaults]")

        p.error = error
    with _parsed(p, argv) as a:
        p.error = refuse  # the flags passed the form's own checks: the run's refusals need no note
        return train_args.run_from_args(p, a)


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("pretrain_gpt", main))
