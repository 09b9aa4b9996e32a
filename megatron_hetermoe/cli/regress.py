"""`hetermoe regress`'s parsers: its own flags and the trainer's after `--` (behaviour:
tools/golden.py; tolerances: training/golden_values.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter
from megatron_hetermoe.cli.train import add_megatron_args


def build_parser(rtol: float, num_zeros_rtol: float) -> argparse.ArgumentParser:
    """The default tolerances are golden_values'."""
    p = argparse.ArgumentParser(prog="hetermoe regress", formatter_class=HelpFormatter,
                                usage="hetermoe regress --golden FILE [--rtol R] [--update] -- <trainer args>\n"
                                      "       hetermoe regress --golden FILE --tensorboard DIR [--rtol R] "
                                      "[--num-zeros-rtol R] [--time-rtol R] [--update]")
    p.add_argument("--golden", required=True, help="golden values JSON (Megatron's layout)")
    p.add_argument("--rtol", type=float, default=rtol,
                   help="relative tolerance per step of lm loss (Megatron's); exact with --deterministic-mode")
    p.add_argument("--update", action="store_true", help="write the run's values as the new golden values")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="no training: compare the pretrain() run that wrote this --tensorboard-dir (lm loss, "
                        "num-zeros, iteration-time, as the golden values have them)")
    p.add_argument("--num-zeros-rtol", type=float, default=num_zeros_rtol,
                   help="with --tensorboard: relative tolerance of num-zeros")
    p.add_argument("--time-rtol", type=float, default=None,
                   help="with --tensorboard: relative tolerance of iteration-time (not compared without it)")
    return p


def build_trainer_parser() -> argparse.ArgumentParser:
    """`hetermoe train`'s model and run flags, on forked ranks only."""
    p = argparse.ArgumentParser(prog="hetermoe regress -- (trainer args)")
    add_megatron_args(p)
    p.add_argument("--nproc", type=int, default=4, help="CPU ranks to start")
    return p
