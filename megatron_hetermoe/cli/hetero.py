"""The --hetero-* flags, defined once for both hostings: Megatron-LM's parser (the patched
pretrain_gpt.py's extra_args_provider, through megatron_lm.add_hetero_args) and `hetermoe train`
(both of its forms)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.config import ISSUERS
from megatron_hetermoe.plan.tasks import SCHEDULES

HETERO_FLAGS = ("--hetero-plan", "--hetero-schedule", "--hetero-ckpt-reshard", "--hetero-zebra-issuer",
                "--hetero-expert-precision", "--hetero-expert-load-stats", "--hetero-gpus",
                "--hetero-replan-interval", "--hetero-replan-margin")


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add HETERO_FLAGS to `parser` in their own group; returns the parser (extra_args_provider's
    contract)."""
    g = parser.add_argument_group(title="HeterMoE (megatron-hetermoe)")
    g.add_argument("--hetero-plan", default=None,
                   help="train with HeterMoE on this plan (hetermoe plan -o plan.json; default: plain Megatron); "
                        "'auto': the planner's search picks the plan for the job's GPUs (--hetero-gpus, or each "
                        "rank's CUDA device under torchrun) and the run's model and batch, at every start")
    g.add_argument("--hetero-gpus", default=None, metavar="CLUSTER|TYPES",
                   help="the job's GPUs for --hetero-plan auto (and hetermoe train's --elastic-restarts): a cluster "
                        "config (as hetermoe plan --cluster) or GPU types in rank order, e.g. 4xA40,4xV100-16GB "
                        "(default: the plan's GPU types; under torchrun, each rank's CUDA device)")
    g.add_argument("--hetero-schedule", choices=list(SCHEDULES), default=None,
                   help="HeterMoE schedule: " + "; ".join(f"{s.name}: {s.summary}" for s in SCHEDULES.values())
                        + " (default: the plan's)")
    g.add_argument("--hetero-ckpt-reshard", action="store_true",
                   help="--load a checkpoint saved under another layout or plan by parameter name (HeterMoE <-> "
                        "Megatron EP; RNG not restored) on the plugin's trainer; inside Megatron-LM's pretrain() "
                        "a checkpoint of another plan loads resharded by itself")
    g.add_argument("--hetero-expert-precision", choices=["bf16", "fp16", "fp32"], default=None,
                   help="the expert ranks' precision (default: the world's, --bf16/--fp16/fp32, which the attention "
                        "ranks run), e.g. fp16 on V100 expert ranks with --bf16 attention ranks; tokens cross in "
                        "it; pools that differ are both 16-bit, and fp16 on either pool gives the world one fp16 "
                        "loss scale")
    g.add_argument("--hetero-zebra-issuer", choices=list(ISSUERS), default="auto",
                   help="zebra: who issues the transfers: 'single', the compute thread with async collectives and "
                        "split sizes sent ahead; 'threads', a worker thread per stream; 'auto': single on GPU ranks "
                        "over NCCL, threads on CPU ranks and emulated clusters (default: auto)")
    g.add_argument("--hetero-expert-load-stats", default=None, metavar="PATH",
                   help="write the measured expert loads (tokens each expert received per MoE layer, each rank's "
                        "compute seconds per task kind) to this JSON file at every log interval, for `hetermoe plan "
                        "--expert-load` (docs/expert-load.md); the loads are logged either way")
    g.add_argument("--hetero-replan-interval", type=int, default=0, metavar="K",
                   help="HeterMoE: every K steps, place the experts anew for the expert loads and per-rank times "
                        "measured since the last decision (same ranks and roles, no rank holding more experts than "
                        "the plan gave it) and move them live, between steps, when the predicted saving pays for the "
                        "move; losses stay bitwise those of a run without moves (docs/expert-load.md#live-moves; "
                        "default: 0, never)")
    g.add_argument("--hetero-replan-margin", type=float, default=2.0, metavar="X",
                   help="--hetero-replan-interval: move only when the predicted saving over the next K steps exceeds "
                        "X times the move's estimated cost (the last move's measured one; before any, one step), and "
                        "the experts' predicted time drops by 5%% or more (default: 2.0)")
    return parser

