"""The demo's parser (behaviour: tools/demo.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo", description=description, formatter_class=HelpFormatter)
    p.add_argument("--out-dir", default="demo-out", help="where timeline.png, plan.json and summary.json go")
    p.add_argument("--steps", type=int, default=150, help="HeterMoE training steps")
    p.add_argument("--measure-steps", type=int, default=3,
                   help="timed steps at the end of each run (after a calibration step)")
    p.add_argument("--max-step-seconds", type=float, default=30.0,
                   help="the longest real step the calibration may stretch a timed step to")
    return p
