"""`hetermoe profile`'s parser (behaviour: tools/profiler.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.formatter import HelpFormatter


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: give positive integers, e.g. 64,128,256")
    return out


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetermoe profile", description=description,
                                formatter_class=HelpFormatter)
    p.add_argument("--gpu-pair", action="store_true",
                   help="measure the all-to-all between two ranks instead (two GPUs over NCCL, else two CPU "
                        "processes over gloo) and write a link profile to --out")
    p.add_argument("--model", help="model config (path or configs/models/ name) whose layer to time "
                   "(required unless --gpu-pair)")
    p.add_argument("--out", required=True, help="profile YAML to write (e.g. configs/gpus/cpu.yaml)")
    p.add_argument("--name", help="GPU type name in the profile (default: the device's name, 'cpu' on CPU)")
    p.add_argument("--seq-lens", type=_ints, help="sequence lengths for attention (default: from the model)")
    p.add_argument("--seqs", type=_ints, default=[1, 2, 4], help="sequences per attention call")
    p.add_argument("--expert-tokens", type=_ints, help="token counts for one expert (default: from the model)")
    p.add_argument("--a2a-bytes", type=_ints, default=[2**12, 2**16, 2**20, 2**23],
                   help="all-to-all message sizes to time, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per point (the median is kept)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="precision to measure (default: the trainers' own, fp32; recorded in the profile)")
    return p
