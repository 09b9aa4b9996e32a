"""The hook that the patches in patches/ put into Megatron-LM's pretrain_gpt.py.

One patch per Megatron-LM release line, since pretrain_gpt.py differs between them (PATCHES):
core_v0.16.1 hands `extra_args_provider` to `pretrain(...)`; core_v0.19.0 parses the arguments
itself with `parse_and_validate_args(extra_args_provider=...)` before calling `pretrain`.
`patch_for(checkout)` names the patch for a checkout (patches/check_patch.sh does the same).

The patched pretrain_gpt.py gets the --hetero-* flags through `extra_args_provider`
(`add_hetero_args`), so Megatron-LM's parser and --help know them. Without --hetero-plan nothing
changes. With it:
- core_v0.16.1: Megatron-LM's own pretrain() runs on every rank, attention and expert alike, with
  the plugin's group setup, model builder, schedule and global gradient norm in place
  (`hetero_pretrain`, training/megatron_lm_hooks.py).
- core_v0.19.0: the run is still handed to this plugin's trainer (`run_hetero`) with the same
  command line, before Megatron-LM's training-side imports (not yet ported to pretrain()).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from megatron_hetermoe.config import ISSUERS
from megatron_hetermoe.training.megatron_lm_hooks import hetero_pretrain, megatron_on_cpu

__all__ = ["add_hetero_args", "hetero_pretrain", "megatron_on_cpu", "hetero_requested", "run_hetero", "patch_for", "checkout_version"]

HETERO_FLAGS = ("--hetero-plan", "--hetero-schedule", "--hetero-ckpt-reshard", "--hetero-zebra-issuer",
                "--hetero-expert-precision")

# megatron-core release line (major, minor) of a Megatron-LM checkout -> the patch made for it.
PATCHES = {
    (0, 16): "megatron-lm-core_v0.16.1-pretrain_gpt.patch",
    (0, 19): "megatron-lm-core_v0.19.0-pretrain_gpt.patch",
}


def checkout_version(checkout) -> tuple[int, int, int]:
    """megatron-core version of a Megatron-LM checkout (its megatron/core/package_info.py)."""
    info = Path(checkout) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise ValueError(f"{checkout} has no megatron/core/package_info.py: pass a Megatron-LM work tree")
    text = info.read_text()
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ValueError(f"cannot read MAJOR/MINOR/PATCH from {info}")
    return tuple(int(m.group(1)) for m in parts)


def patch_for(checkout) -> str:
    """File name (in patches/) of the patch made for this Megatron-LM checkout's release line."""
    v = checkout_version(checkout)
    name = PATCHES.get(v[:2])
    if name is None:
        made = ", ".join(f"core_v{a}.{b}.x" for a, b in sorted(PATCHES))
        raise ValueError(f"no patch for Megatron-LM core_v{'.'.join(map(str, v))} ({checkout}); patches exist for {made}")
    return name


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM extra_args_provider: the plugin's flags, as `hetermoe train` spells them."""
    g = parser.add_argument_group(title="HeterMoE (megatron-hetermoe)")
    g.add_argument("--hetero-plan", default=None, help="train with HeterMoE on this plan (hetermoe plan -o plan.json)")
    g.add_argument("--hetero-schedule", choices=["distep", "zebra"], default=None,
                   help="HeterMoE schedule (default: the plan's)")
    g.add_argument("--hetero-ckpt-reshard", action="store_true",
                   help="--load a checkpoint saved with another layout (HeterMoE <-> Megatron EP) on the plugin's "
                        "trainer; inside Megatron-LM's pretrain() dist_checkpointing reshards by itself "
                        "(--no-load-optim --no-load-rng)")
    g.add_argument("--hetero-expert-precision", choices=["bf16", "fp16", "fp32"], default=None,
                   help="the expert ranks' precision (default: the world's, --bf16/--fp16, which the attention "
                        "ranks run), e.g. fp16 on V100 expert ranks with --bf16; tokens cross in it")
    g.add_argument("--hetero-zebra-issuer", choices=list(ISSUERS), default="auto",
                   help="zebra: who issues the transfers: 'single' (the compute thread, async collectives), "
                        "'threads' (a worker thread per stream), 'auto' (single on GPU ranks over NCCL, else threads)")
    return parser


def hetero_requested(argv: list[str]) -> bool:
    """Whether this command line asks for HeterMoE (--hetero-plan given)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--hetero-plan", default=None)
    known, _ = p.parse_known_args(argv)
    return known.hetero_plan is not None


def run_hetero(argv: list[str]) -> int:
    """Run Megatron-LM's command line on the plugin's trainer (joins the torchrun job); the
    core_v0.19.0 patch's hand-off."""
    from megatron_hetermoe.training.pretrain_gpt import main

    return main(argv)
