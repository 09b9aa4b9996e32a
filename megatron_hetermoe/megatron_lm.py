"""The hook that patches/megatron-lm-core_v0.16.1-pretrain_gpt.patch puts into Megatron-LM.

The patched pretrain_gpt.py gets the --hetero-* flags through `extra_args_provider`
(`add_hetero_args`), so Megatron-LM's parser and --help know them. A run with --hetero-plan is
handed to this plugin's trainer (`run_hetero`) with the same command line: HeterMoE replaces
Megatron-LM's training loop for that run (expert ranks build no GPTModel, and the zebra
schedule drives both roles), while the flags keep Megatron-LM's names and meanings and a flag
this plugin does not support is refused by name. Without --hetero-plan nothing changes.
"""
from __future__ import annotations

import argparse

HETERO_FLAGS = ("--hetero-plan", "--hetero-schedule", "--hetero-ckpt-reshard")


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM extra_args_provider: the plugin's flags, as `hetermoe train` spells them."""
    g = parser.add_argument_group(title="HeterMoE (megatron-hetermoe)")
    g.add_argument("--hetero-plan", default=None, help="train with HeterMoE on this plan (hetermoe plan -o plan.json)")
    g.add_argument("--hetero-schedule", choices=["distep", "zebra"], default=None,
                   help="HeterMoE schedule (default: the plan's)")
    g.add_argument("--hetero-ckpt-reshard", action="store_true",
                   help="--load a checkpoint saved with another layout (HeterMoE <-> Megatron EP)")
    return parser


def hetero_requested(argv: list[str]) -> bool:
    """Whether this command line asks for HeterMoE (--hetero-plan given)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--hetero-plan", default=None)
    known, _ = p.parse_known_args(argv)
    return known.hetero_plan is not None


def run_hetero(argv: list[str]) -> int:
    """Run Megatron-LM's command line on the plugin's trainer (joins the torchrun job)."""
    from .pretrain_gpt import main

    return main(argv)
