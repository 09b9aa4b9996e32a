"""The --hetero-* flags, defined once for both hostings: Megatron-LM's parser (the patched
pretrain_gpt.py's extra_args_provider, through megatron_lm.add_hetero_args) and `hetermoe train`
(both of its forms)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.flags import FlagRows, add_flags
from megatron_hetermoe.config import ISSUERS
from megatron_hetermoe.plan.tasks import SCHEDULES

HETERO_FLAGS = ("--hetero-plan", "--hetero-schedule", "--hetero-ckpt-reshard", "--hetero-zebra-issuer",
                "--hetero-expert-precision", "--hetero-expert-load-stats", "--hetero-gpus",
                "--hetero-replan-interval", "--hetero-replan-margin")


# HETERO_FLAGS' rows, in --help order.
_HETERO_ARGS: FlagRows = (
    ("--hetero-plan", dict(default=None),
     "train with HeterMoE on this plan (hetermoe plan -o plan.json; default: plain Megatron); "
     "'auto': the planner's search picks the plan for the job's GPUs (--hetero-gpus, or each "
     "rank's CUDA device under torchrun) and the run's model and batch, at every start"),
    ("--hetero-gpus", dict(default=None, metavar="CLUSTER|TYPES"),
     "the job's GPUs for --hetero-plan auto (and hetermoe train's --elastic-restarts): a cluster "
     "config (as hetermoe plan --cluster) or GPU types in rank order, e.g. 4xA40,4xV100-16GB "
     "(default: the plan's GPU types; under torchrun, each rank's CUDA device)"),
    ("--hetero-schedule", dict(choices=list(SCHEDULES), default=None),
     "HeterMoE schedule: " + "; ".join(f"{s.name}: {s.summary}" for s in SCHEDULES.values())
     + " (default: the plan's)"),
    ("--hetero-ckpt-reshard", dict(action="store_true"),
     "--load a checkpoint saved under another layout or plan by parameter name (HeterMoE <-> "
     "Megatron EP; RNG not restored) on the plugin's trainer; inside Megatron-LM's pretrain() "
     "a checkpoint of another plan loads resharded by itself"),
    ("--hetero-expert-precision", dict(choices=["bf16", "fp16", "fp32"], default=None),
     "the expert ranks' precision (default: the world's, --bf16/--fp16/fp32, which the attention "
     "ranks run), e.g. fp16 on V100 expert ranks with --bf16 attention ranks; tokens cross in "
     "it; pools that differ are both 16-bit, and fp16 on either pool gives the world one fp16 "
     "loss scale"),
    ("--hetero-zebra-issuer", dict(choices=list(ISSUERS), default="auto"),
     "zebra: who issues the transfers: 'single', the compute thread with async collectives and "
     "split sizes sent ahead; 'threads', a worker thread per stream; 'auto': single on GPU ranks "
     "over NCCL, threads on CPU ranks and emulated clusters (default: auto)"),
    ("--hetero-expert-load-stats", dict(default=None, metavar="PATH"),
     "write the measured expert loads (tokens each expert received per MoE layer, each rank's "
     "compute seconds per task kind) to this JSON file at every log interval, for `hetermoe plan "
     "--expert-load` (docs/expert-load.md); the loads are logged either way"),
    ("--hetero-replan-interval", dict(type=int, default=0, metavar="K"),
     "HeterMoE: every K steps, place the experts anew for the expert loads and per-rank times "
     "measured since the last decision (same ranks and roles, no rank holding more experts than "
     "the plan gave it) and move them live, between steps, when the predicted saving pays for the "
     "move; losses stay bitwise those of a run without moves (docs/expert-load.md#live-moves; "
     "default: 0, never)"),
    ("--hetero-replan-margin", dict(type=float, default=2.0, metavar="X"),
     "--hetero-replan-interval: move only when the predicted saving over the next K steps exceeds "
     "X times the move's estimated cost (the last move's measured one; before any, one step), and "
     "the experts' predicted time drops by 5%% or more (default: 2.0)"),
)


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add HETERO_FLAGS to `parser` in their own group; returns the parser (extra_args_provider's
    contract)."""
    g = parser.add_argument_group(title="HeterMoE (megatron-hetermoe)")
    add_flags(g, _HETERO_ARGS)
    return parser

