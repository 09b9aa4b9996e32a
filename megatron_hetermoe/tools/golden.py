"""`hetermoe regress`: rerun a training and compare its per-step lm loss with golden values; or,
with --tensorboard DIR, compare a finished Megatron pretrain() run (Megatron-LM's or `hetermoe
pretrain`'s --tensorboard-dir) with golden values of its lm loss, num-zeros and iteration time, as
Megatron's functional tests keep them.

The format, the exact-vs-tolerance rules and on which kernels exact values hold:
training/golden_values.py.
"""
from __future__ import annotations

import argparse
import sys

from megatron_hetermoe.training.golden_values import (
    DEFAULT_METRIC_RTOL,
    DEFAULT_RTOL,
    compare,
    kernels,
    max_rel_diff,
    read_golden,
    write_golden,
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, trainer_argv = argv[:i], argv[i + 1:]
    else:
        own, trainer_argv = argv, []
    from megatron_hetermoe.cli.regress import build_parser, build_trainer_parser

    p = build_parser(DEFAULT_RTOL, DEFAULT_METRIC_RTOL["num-zeros"])
    a = p.parse_args(own)
    if a.tensorboard is not None:
        if trainer_argv:
            p.error("--tensorboard compares a finished run: give no trainer args after --")
        return _regress_tensorboard(a)

    from megatron_hetermoe.outputs import writable_file
    from megatron_hetermoe.training import args as train_args

    tp = build_trainer_parser()
    ta = tp.parse_args(trainer_argv)
    if not 1 <= ta.nproc <= train_args.MAX_FORKED_RANKS:
        tp.error(f"--nproc {ta.nproc}: start 1 to {train_args.MAX_FORKED_RANKS} CPU ranks")
    # The golden file first: a missing or malformed one is reported before the training run.
    golden = None if a.update else read_golden(a.golden)
    if a.update:
        writable_file("--golden", a.golden)
    try:
        cfg = train_args.config_from_args(ta)
    except (ValueError, FileNotFoundError) as e:
        tp.error(str(e))
    cfg.quiet = True
    import megatron.core  # noqa: F401  - import once, then fork ranks

    result = train_args.run(cfg, ta.nproc)
    losses, start = result.losses, result.start_iteration + 1
    if a.update:
        write_golden(a.golden, losses, start_step=start)
        print(f"wrote {len(losses)} golden values to {a.golden} (exact on {kernels()} only)")
        return 0
    problems = compare(golden, losses, a.rtol, exact=cfg.deterministic, start_step=start)
    for step, v in enumerate(losses, start):
        want = golden.get(step)
        print(f"step {step:>4}: lm loss {v:.8f}" + (f"  golden {want:.8f}" if want is not None else ""))
    worst = max_rel_diff(golden, losses, start)
    if problems:
        print("REGRESSION:\n  " + "\n  ".join(problems))
        if cfg.deterministic:
            print(f"  (exact comparison: golden values made on other kernels than {kernels()} differ by round-off)")
        return 1
    print(f"OK: {len(golden)} steps match ({'exact' if cfg.deterministic else f'rtol {a.rtol}'}; "
          f"max rel diff {worst:.3e})")
    return 0


def _regress_tensorboard(a: argparse.Namespace) -> int:
    """A finished pretrain() run's tensorboard scalars against golden values, metric by metric."""
    import json
    from pathlib import Path

    from megatron_hetermoe.outputs import writable_file
    from megatron_hetermoe.training.golden_values import (
        compare_metrics,
        golden_from_scalars,
        read_golden_metrics,
        scalars_from_tensorboard,
    )

    golden = None if a.update else read_golden_metrics(a.golden)  # a bad file before reading the run
    if a.update:
        writable_file("--golden", a.golden)
    run = scalars_from_tensorboard(a.tensorboard)
    if a.update:
        Path(a.golden).write_text(json.dumps(golden_from_scalars(run), indent=2) + "\n")
        print(f"wrote golden values of {', '.join(run)} to {a.golden} (from {a.tensorboard}; {kernels()})")
        return 0
    rtol = {"lm loss": a.rtol, "num-zeros": a.num_zeros_rtol}
    if a.time_rtol is not None:
        rtol["iteration-time"] = a.time_rtol
    for metric, want in sorted(golden.items()):
        got = run.get(metric, {})
        for step in sorted(want):
            seen = f"{got[step]:.8g}" if step in got else "-"
            print(f"step {step:>4}: {metric} {seen}  golden {want[step]:.8g}"
                  + ("" if metric in rtol else "  (not compared)"))
    problems = compare_metrics(golden, run, rtol)
    if problems:
        print("REGRESSION:\n  " + "\n  ".join(problems))
        return 1
    compared = [m for m in sorted(golden) if m in rtol]
    print(f"OK: {', '.join(compared)} match the golden values ("
          + ", ".join(f"{m} rtol {rtol[m]}" for m in compared) + ")")
    return 0


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe regress", main))
