"""`hetermoe` console script (`python -m megatron_hetermoe.cli`: cli/__main__.py). Its parsers are in
cli/. Each subcommand lives in the module named for its idea and is
imported only when used (planning needs no torch).

A command ends in one line `hetermoe COMMAND: error: ...` (exit code 1) on a user's error, a
rank's included, and with a traceback on a bug ($HETERMOE_TRACEBACK=1: always). SIGTERM ends it
with code 143 after stopping its ranks.

Options before the command apply to all of them: `--version`, and `--config-dir DIR` (the
models/, gpus/, clusters/ that bare names like `--model tiny` are looked up in; the same as
$HETERMOE_CONFIG_DIR). `--config-dir` is also taken after the command (before a `--`).
"""
from __future__ import annotations

import importlib
import sys

from megatron_hetermoe.cli.hetermoe import build_parser

# name -> (module:function taking argv and returning an exit code, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_hetermoe.training.command:main",
              "train the baseline Megatron MoE (or HeterMoE with --hetero-plan); the model from --model, or from "
              "Megatron-LM pretrain_gpt.py flags (--num-layers ...)"),
    "pretrain": ("megatron_hetermoe.megatron_lm.pretrain:main",
                 "Megatron's own pretrain() with Megatron-LM flags (megatron-core >= 0.19, or MEGATRON_LM_DIR)"),
    "train-gpt": ("megatron_hetermoe.training.pretrain_gpt:main",
                  "alias of `hetermoe train` in its pretrain_gpt.py form, for any flags (kept for compatibility)"),
    "regress": ("megatron_hetermoe.tools.golden:main", "rerun a training and compare its loss with golden values"),
    "parity": ("megatron_hetermoe.tools.parity:main",
               "HeterMoE vs plain Megatron EP: per-step loss and gradient diffs"),
    "bench": ("megatron_hetermoe.tools.bench:main",
              "HeterMoE vs Megatron EP side by side on an emulated mixed cluster"),
    "checkpoint": ("megatron_hetermoe.checkpoint.export:main",
                   "export a HeterMoE checkpoint to plain Megatron, or import one"),
    "timeline": ("megatron_hetermoe.tools.timeline:main", "draw a run's timeline (PNG + Chrome trace for Perfetto)"),
    "plan": ("megatron_hetermoe.planner.cli_plan:main", "write a plan (--even, or searched from profiles)"),
    "profile": ("megatron_hetermoe.tools.profiler:main", "profile this device into a GPU profile YAML"),
}


def versions() -> str:
    """This package's version and what it runs on, read from metadata (imports no torch)."""
    from importlib import metadata
    from importlib.util import find_spec

    from megatron_hetermoe import __version__

    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        if not find_spec("megatron_hetermoe._csim"):
            csim = "not built (pure-Python simulator)"
        else:
            from megatron_hetermoe.planner.simulator import have_cpp

            csim = "built" if have_cpp() else "stale (built from an older csrc/simulator.cpp; pure-Python simulator)"
    except ImportError:
        csim = "not built (pure-Python simulator)"
    py = ".".join(map(str, sys.version_info[:3]))
    return (f"megatron-hetermoe {__version__} (torch {ver('torch')}, megatron-core {ver('megatron-core')}, "
            f"Python {py}, C++ simulator {csim})")


def _take_config_dir(rest: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config-dir DIR` / `--config-dir=DIR` out of a command's own arguments (up to `--`)."""
    out, found, i = [], None, 0
    while i < len(rest):
        a = rest[i]
        if a == "--":
            out += rest[i:]
            break
        if a == "--config-dir" and i + 1 < len(rest):
            found, i = rest[i + 1], i + 2
            continue
        if a.startswith("--config-dir="):
            found, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    return found, out


def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.errors import run_command
    from megatron_hetermoe.parallel.launcher import show_warnings_once

    argv = list(sys.argv[1:] if argv is None else argv)
    # The options before the command name are ours; the rest belongs to the command.
    cut, i = len(argv), 0
    while i < len(argv):
        if argv[i] == "--config-dir":
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            cut = i
            break
    parser = build_parser(SUBCOMMANDS)
    top, unknown = parser.parse_known_args(argv[:cut])
    if unknown or (cut < len(argv) and argv[cut] not in SUBCOMMANDS):
        what = f"option {unknown[0]!r}" if unknown else f"command {argv[cut]!r}"
        print(f"hetermoe: unknown {what}; commands: {', '.join(SUBCOMMANDS)} (hetermoe --help)", file=sys.stderr)
        return 2
    if top.version:
        print(versions())
        return 0
    if top.help or cut == len(argv):
        parser.print_help()
        return 0 if top.help else 2
    name, rest = argv[cut], argv[cut + 1:]
    config_dir, rest = _take_config_dir(rest)
    config_dir = config_dir or top.config_dir
    if config_dir is not None:
        from megatron_hetermoe.paths import set_config_dir

        try:
            set_config_dir(config_dir)
        except FileNotFoundError as e:
            print(f"hetermoe: {e}", file=sys.stderr)
            return 2
    show_warnings_once()  # megatron's import-time warnings, and each rank's, once per command
    mod, fn = SUBCOMMANDS[name][0].split(":")
    try:
        # A user's error (a rank's too) is one line; a bug keeps its traceback (errors.py).
        return run_command(f"hetermoe {name}", getattr(importlib.import_module(mod), fn), rest)
    except ImportError as e:
        from megatron_hetermoe import MissingExtraError

        if not isinstance(e, MissingExtraError):
            raise
        print(f"hetermoe {name}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
