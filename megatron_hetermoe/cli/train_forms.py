"""`hetermoe train`'s two forms: the rule that picks one from a command line, and the config form's
parser with the rule in its help (the forms' own parsers: cli/train.py, cli/train_gpt.py)."""
from __future__ import annotations

import argparse
import textwrap
from typing import Sequence

from megatron_hetermoe.cli import train
from megatron_hetermoe.cli.train_gpt import add_model_args


def model_flags() -> frozenset[str]:
    """The flags only the pretrain_gpt.py form takes (add_model_args'); the config form has none of them."""
    p = argparse.ArgumentParser(add_help=False)
    add_model_args(p)
    return frozenset(o for a in p._actions for o in a.option_strings)


def pretrain_gpt_form_flag(argv: Sequence[str]) -> str | None:
    """The rule: the first flag of `argv` (by its full name, `--flag` or `--flag=value`) that only the
    pretrain_gpt.py form takes; the command line is then read as Megatron-LM's pretrain_gpt.py reads it.
    None: the config form (the model from --model, default tiny)."""
    flags = model_flags()
    return next((f for f in (t.split("=", 1)[0] for t in argv if t.startswith("--")) if f in flags), None)


def forms_epilog() -> str:
    """The config form's help ends with the rule and the pretrain_gpt.py form's own flags."""
    rule = ("Two forms, picked from the command line. Any flag listed below (Megatron-LM's model, recipe and "
            "evaluation flags) gives the pretrain_gpt.py form: the model's shape as flags (starting from --model's "
            "YAML if given), Megatron-LM's defaults (--min-lr 0, --global-batch-size required), the recipe flags "
            "--swiglu ... --lr-decay-style cosine required, and a Megatron-LM flag not supported here refused by "
            "name. Without any of them, the config form above: the model from --model (default tiny), the defaults "
            "shown. `hetermoe train-gpt` is the pretrain_gpt.py form always; `hetermoe train-gpt --help` shows "
            "that form's flags with their help.")
    names = " ".join(sorted(model_flags()))
    return (textwrap.fill(rule, 100, break_on_hyphens=False) + "\n\npretrain_gpt.py form only:\n"
            + textwrap.fill(names, 100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))


def config_form_parser(progress_timeout_s: float, prog: str = "hetermoe train") -> argparse.ArgumentParser:
    """The config form's parser (cli/train.py), its help ending with the rule (forms_epilog)."""
    p = train.build_parser(progress_timeout_s, prog)
    p.epilog = forms_epilog()
    return p
