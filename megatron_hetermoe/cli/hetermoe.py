"""`hetermoe`'s own options, before the command name (commands.py dispatches)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def build_parser(commands: dict[str, tuple[str, str]]) -> argparse.ArgumentParser:
    """`commands`: name -> (module:function, one-line help), listed in the epilog."""
    p = argparse.ArgumentParser(
        prog="hetermoe", formatter_class=HelpFormatter, add_help=False,
        description="HeterMoE (arXiv 2504.03871) as a Megatron-Core plugin. "
                    "`hetermoe COMMAND --help` describes each command's flags.",
        epilog="commands:\n" + "\n".join(f"  {n:<11} {doc}" for n, (_, doc) in commands.items()))
    p.add_argument("-h", "--help", action="store_true", help="show this message and exit")
    p.add_argument("--version", action="store_true", help="print the version of this package, torch and "
                   "megatron-core, and whether the C++ simulator is built, then exit")
    p.add_argument("--config-dir", metavar="DIR", default=None,
                   help="look up bare config names (--model tiny, --cluster o1, GPU types) in DIR/models, "
                        "DIR/gpus, DIR/clusters (default: $HETERMOE_CONFIG_DIR, else the repository's "
                        "configs/ in a checkout, else the configs shipped in the package)")
    return p
