"""`hetermoe train`: one command, two forms, picked once from the command line.

- The pretrain_gpt.py form (training/pretrain_gpt.py), when the command line has a flag that only it
  takes: Megatron-LM's model, recipe and evaluation flags (--num-layers, --hidden-size, --swiglu,
  --vocab-size, --eval-iters, ...; cli/train_forms.pretrain_gpt_form_flag), with or without --model
  (its YAML is then where the shape starts). Megatron-LM's defaults, the recipe flags required, a
  Megatron-LM flag not supported here refused by name.
- Otherwise the config form (training/args.py): the model from --model (default tiny), this trainer's
  defaults.

No command line of either form reads as the other: the config form has none of those flags, and the
pretrain_gpt.py form requires its recipe flags, which are among them. `hetermoe train-gpt` and
`python -m megatron_hetermoe.training.pretrain_gpt` are the pretrain_gpt.py form for any flags.
"""
from __future__ import annotations

import sys

from megatron_hetermoe.cli.train_forms import pretrain_gpt_form_flag
from megatron_hetermoe.training import args as train_args
from megatron_hetermoe.training import pretrain_gpt


def main(argv: list[str] | None = None) -> int:
    """Run `hetermoe train ARGV` in the form ARGV picks (the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen_by = pretrain_gpt_form_flag(argv)
    if chosen_by is not None:
        return pretrain_gpt.main(argv, prog="hetermoe train", chosen_by=chosen_by)
    return train_args.main(argv)


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe train", main))
