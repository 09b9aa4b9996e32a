"""`hetermoe checkpoint`'s parser: export and import (behaviour: checkpoint/export.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetermoe checkpoint", formatter_class=HelpFormatter,
                                description="convert between HeterMoE checkpoints and plain Megatron dist checkpoints")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", formatter_class=HelpFormatter,
                       help="HeterMoE checkpoint -> plain Megatron (PP=1, EP=1) dist checkpoint")
    e.add_argument("--load", required=True, help="HeterMoE checkpoint directory (hetermoe train --save)")
    e.add_argument("--plan", default=None,
                   help="the plan it was trained with (checked against the checkpoint; default: not checked)")
    e.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default: the latest)")
    e.add_argument("-o", "--out", required=True, help="output directory (Megatron layout)")
    i = sub.add_parser("import", formatter_class=HelpFormatter,
                       help="plain Megatron dist checkpoint -> HeterMoE checkpoint for a plan")
    i.add_argument("--load", required=True, help="Megatron dist checkpoint directory")
    i.add_argument("--plan", required=True, help="plan to lay the checkpoint out for")
    i.add_argument("--model", default=None,
                   help="model config, when the checkpoint does not record it (default: the checkpoint's)")
    i.add_argument("-o", "--out", required=True, help="output directory (load with hetermoe train --load)")
    return p
