"""`hetermoe pretrain`'s parsers: its own flags before Megatron-LM's (behaviour:
megatron_lm/pretrain.py), and the one flag a Megatron-LM command line is read for before
Megatron-LM parses it (megatron_lm.hetero_requested)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def build_parser(description: str) -> argparse.ArgumentParser:
    """This command's own flags; every other flag is Megatron-LM's (its parser's --help lists them)."""
    p = argparse.ArgumentParser(prog="hetermoe pretrain", add_help=False, allow_abbrev=False,
                                formatter_class=HelpFormatter, description=description,
                                usage="hetermoe pretrain [--nproc N] <Megatron-LM pretrain_gpt.py flags> "
                                      "[--hetero-plan plan.json]")
    p.add_argument("-h", "--help", action="store_true",
                   help="show this help, then Megatron-LM's flags, and exit (default: off)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks to start on this host with torch.distributed.run, outside torchrun only "
                        "(default: the --hetero-plan's world size, else 1)")
    return p


def hetero_plan_parser() -> argparse.ArgumentParser:
    """--hetero-plan and --hetero-gpus alone, among Megatron-LM's flags (parse_known_args)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--hetero-plan", default=None)
    p.add_argument("--hetero-gpus", default=None)
    return p
