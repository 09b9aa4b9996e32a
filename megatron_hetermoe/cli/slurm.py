"""`python -m megatron_hetermoe.tools.slurm`'s parser (behaviour: tools/slurm.py), and the parser a
megatron-core >= 0.19 job's nodes will use, to check its flags with on the login node."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from megatron_hetermoe.cli.hetero import add_hetero_args


def build_parser(entries: tuple[str, ...], max_connections: int) -> argparse.ArgumentParser:
    """`entries`: the --entry choices; `max_connections`: --cuda-device-max-connections' default."""
    p = argparse.ArgumentParser(prog="python -m megatron_hetermoe.tools.slurm",
                                description="render the sbatch script (and per-task commands) for a plan")
    p.add_argument("--plan", required=True, help="the plan; a relative path is relative to --workdir")
    p.add_argument("--gpus-per-node", action="append", default=[], metavar="[TYPE=]N",
                   help="GPUs per node, per GPU type (a40=4) or for all types (8); repeatable")
    p.add_argument("--partition", action="append", default=[], metavar="[TYPE=]NAME")
    p.add_argument("--constraint", action="append", default=[], metavar="[TYPE=]FEATURE",
                   help="node feature of each GPU type (default: the type name)")
    p.add_argument("--account", default=None)
    p.add_argument("--time", default=None)
    p.add_argument("--job-name", default="hetermoe")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on rank 0's node, 1..65535")
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]),
                   help="this repository's path on the nodes (the plugin and scripts/slurm/rank.sh)")
    p.add_argument("--workdir", default=None, help="directory the tasks run in (default: the current one)")
    p.add_argument("--python", default=os.environ.get("PYTHON") or sys.executable,
                   help="the tasks' interpreter (default: $PYTHON, else this one); $PYTHON at run time wins")
    p.add_argument("--entry", choices=entries, default="plugin",
                   help="plugin: this plugin's trainer; megatron-lm: Megatron-LM's patched pretrain_gpt.py "
                        "(--megatron-lm-dir); megatron-core: megatron-core >= 0.19's own pretrain(), no checkout")
    p.add_argument("--megatron-lm-dir", default=None, help="the Megatron-LM checkout, with --entry megatron-lm")
    p.add_argument("--cuda-device-max-connections", type=int, default=max_connections,
                   help="CUDA_DEVICE_MAX_CONNECTIONS of every task (1 serialises zebra's streams: refused with zebra)")
    p.add_argument("--elastic", type=int, default=None, metavar="MIN_NODES",
                   help="torchrun's elastic agent on every node: the job goes on while at least MIN_NODES nodes are "
                        "left, each start planning for the GPUs it got (--hetero-plan auto) and continuing from the "
                        "latest checkpoint (--save, --load, --save-interval among the flags, and --hetero-ckpt-reshard "
                        "for --entry plugin); --plan then sizes the allocation")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="with --elastic: torchrun's --max-restarts (starts after a failure, over the whole job)")
    p.add_argument("--tasks", action="store_true", help="print each task's command instead of the script")
    p.add_argument("--with-tasks", action="store_true", help="print the script, then each task's command (dry run)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then pretrain_gpt flags")
    return p


def megatron_core_parser(add_megatron_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
                         ) -> argparse.ArgumentParser:
    """megatron.training's parser (its add_megatron_arguments, imported by the caller) with the
    --hetero-* flags, as the patch-free pretrain() of megatron-core >= 0.19 builds it."""
    return add_hetero_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
