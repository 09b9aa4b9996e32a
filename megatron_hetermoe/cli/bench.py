"""`hetermoe bench`'s parsers: the emulated cluster's strategies side by side (behaviour:
tools/bench.py) and, with --layer, one MoE layer (tools/layer_bench.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def _step_seconds(s: str) -> float | None:
    if s == "auto":
        return None
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give seconds or 'auto'") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: must be > 0")
    return v


def build_parser(description: str, strategies: tuple[str, ...]) -> argparse.ArgumentParser:
    """`strategies`: the names --only picks from."""
    p = argparse.ArgumentParser(prog="hetermoe bench", description=description, formatter_class=HelpFormatter)
    p.add_argument("--layer", action="store_true",
                   help="time one MoE layer, HeteroMoELayer against megatron's MoELayer (`hetermoe bench --layer -h`)")
    p.add_argument("--cluster", required=True, help="the emulated cluster: configs/clusters/NAME.yaml or a path")
    p.add_argument("--model", required=True, help="the emulated model shape (e.g. d1)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence of the emulated model")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 4 per GPU)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per strategy (after warm-up and calibration)")
    p.add_argument("--step-seconds", type=_step_seconds, default=None, metavar="auto|SECONDS",
                   help="'auto' (default): each run picks its scale from a calibration step so that the emulation "
                        "holds; SECONDS: real seconds of the Zebra+Asym-EA step (one scale for all)")
    p.add_argument("--max-step-seconds", type=float, default=30.0,
                   help="auto: the longest real step a run may stretch to")
    p.add_argument("--max-overrun", type=float, default=0.03,
                   help="a run whose real work and host delays add more than this fraction of its step is invalid")
    p.add_argument("--only", default=",".join(strategies), help="comma-separated subset of " + ", ".join(strategies))
    p.add_argument("--timeline-dir", default=None, help="write each HeterMoE run's timeline here")
    p.add_argument("--json", action="store_true", help="print the report as JSON (valid, invalid_reason, ...)")
    return p


def build_layer_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetermoe bench --layer", description=description, formatter_class=HelpFormatter)
    p.add_argument("--model", default="d1", help="the model whose MoE layer is timed (configs/models/NAME.yaml)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the microbatch")
    p.add_argument("--repeats", type=int, default=20, help="timed pairs of passes")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    return p
