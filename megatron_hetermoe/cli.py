"""`hetermoe` console script. Each subcommand lives in the module named for its idea and is
imported only when used (planning needs no torch)."""
from __future__ import annotations

import importlib
import sys

# name -> (module:function taking argv and returning an exit code, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_hetermoe.trainer:main", "train the baseline Megatron MoE (or HeterMoE with --hetero-plan)"),
    "pretrain": ("megatron_hetermoe.pretrain_gpt:main", "train with Megatron-LM pretrain_gpt.py flags (model shape as flags)"),
    "regress": ("megatron_hetermoe.golden:main", "rerun a training and compare its loss with golden values"),
    "parity": ("megatron_hetermoe.parity:main", "HeterMoE vs plain Megatron EP: per-step loss and gradient diffs"),
    "bench": ("megatron_hetermoe.bench:main", "HeterMoE vs Megatron EP side by side on an emulated mixed cluster"),
    "checkpoint": ("megatron_hetermoe.checkpoint_export:main", "export a HeterMoE checkpoint to plain Megatron, or import one"),
    "timeline": ("megatron_hetermoe.timeline:main", "draw a run's timeline (PNG + Chrome trace for Perfetto)"),
    "plan": ("megatron_hetermoe.planner.cli_plan:main", "write a plan (--even, or searched from profiles)"),
    "profile": ("megatron_hetermoe.planner.profiler:main", "profile this device into a GPU profile YAML"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hetermoe <command> [args]\n\ncommands:")
        for name, (_, doc) in SUBCOMMANDS.items():
            print(f"  {name:<10} {doc}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"hetermoe: unknown command {name!r}; commands: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    mod, fn = SUBCOMMANDS[name][0].split(":")
    return int(getattr(importlib.import_module(mod), fn)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
