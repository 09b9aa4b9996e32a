"""The run's HeteroRunConfig from the parsed --hetero-* flags (defined in cli/hetero.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.config import HeteroRunConfig


def hetero_run_config(args: argparse.Namespace, recompute: bool = False,
                      timeline_dir: str | None = None) -> HeteroRunConfig:
    """The run's HeteroRunConfig from the parsed --hetero-* flags (and the plugin trainer's own
    --recompute-granularity full and --timeline-dir)."""
    return HeteroRunConfig(args.hetero_schedule, recompute, timeline_dir, args.hetero_expert_precision,
                           args.hetero_zebra_issuer, getattr(args, "hetero_expert_load_stats", None),
                           replan_interval=getattr(args, "hetero_replan_interval", 0),
                           replan_margin=getattr(args, "hetero_replan_margin", 2.0))
