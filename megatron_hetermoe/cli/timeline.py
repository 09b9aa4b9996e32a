"""`hetermoe timeline`'s parser (behaviour: tools/timeline.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetermoe timeline", description="draw a run's timeline",
                                formatter_class=HelpFormatter)
    p.add_argument("run_dir", help="a --timeline-dir of hetermoe train / bench (timeline.rank*.json)")
    p.add_argument("-o", "--output", default=None, help="PNG path (default RUN_DIR/timeline.png)")
    p.add_argument("--step", type=int, default=None, help="draw one step only (default: the last)")
    return p
