"""Golden values in Megatron's CI layout, and `hetermoe regress`.

Layout: {"lm loss": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {"1": v, ...}}}.
Comparison is exact in deterministic mode (--deterministic-mode among the trainer args), else
Megatron's relative tolerance 0.05.

Exact holds only on the kernels the values were written with: deterministic mode fixes the
summation order of one build on one CPU, but another torch build or ATen kernel set (AVX-512
vs AVX2 vs default, chosen by the CPU or ATEN_CPU_CAPABILITY) rounds differently. `--update`
prints the torch version and kernel set; compare exactly only against values made there, and
ship golden values for other machines in tolerance mode (tests/golden_values/ are: measured
across default/avx2/avx512, the worst step differs by 5.2e-4 relative, against 0.05).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_RTOL = 0.05


def golden_dict(losses: list[float], metric: str = "lm loss") -> dict:
    return {metric: {"start_step": 1, "end_step": len(losses), "step_interval": 1,
                     "values": {str(i + 1): float(v) for i, v in enumerate(losses)}}}


def write_golden(path: str | Path, losses: list[float]) -> None:
    Path(path).write_text(json.dumps(golden_dict(losses), indent=2) + "\n")


def read_golden(path: str | Path, metric: str = "lm loss") -> dict[int, float]:
    d = json.loads(Path(path).read_text())
    if metric not in d or "values" not in d[metric]:
        raise ValueError(f"{path}: no {metric!r} golden values (keys: {sorted(d)})")
    return {int(k): float(v) for k, v in d[metric]["values"].items()}


def max_rel_diff(golden: dict[int, float], losses: list[float]) -> float:
    """The largest relative difference over the steps both have."""
    return max((abs(losses[s - 1] - v) / abs(v) if v else math.inf for s, v in golden.items() if s <= len(losses)),
               default=0.0)


def kernels() -> str:
    """Which build and ATen CPU kernels produced a run's numbers (exact golden values hold there only)."""
    import torch

    return f"torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}"


def compare(golden: dict[int, float], losses: list[float], rtol: float, exact: bool) -> list[str]:
    """Human-readable mismatches; empty when the run matches."""
    problems = []
    if len(losses) < max(golden):
        problems.append(f"run has {len(losses)} steps but golden values go to step {max(golden)}")
    for step, want in sorted(golden.items()):
        if step > len(losses):
            break
        got = losses[step - 1]
        if exact:
            bad = got != want
        else:
            bad = not math.isfinite(got) or abs(got - want) > rtol * abs(want)
        if bad:
            rel = abs(got - want) / abs(want) if want else float("inf")
            problems.append(f"step {step}: lm loss {got!r} vs golden {want!r} (rel diff {rel:.3e}, "
                            f"{'exact match required' if exact else f'rtol {rtol}'})")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1:]
    else:
        own, train_args = argv, []
    from megatron_hetermoe.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="hetermoe regress", formatter_class=HelpFormatter, usage="hetermoe regress --golden FILE [--rtol R] [--update] -- <trainer args>")
    p.add_argument("--golden", required=True, help="golden values JSON (Megatron's layout)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help="relative tolerance per step (Megatron's); exact with --deterministic-mode")
    p.add_argument("--update", action="store_true", help="write the run's losses as the new golden values")
    a = p.parse_args(own)

    from megatron_hetermoe.training import megatron_ep as trainer

    tp = argparse.ArgumentParser(prog="hetermoe regress -- (trainer args)")
    trainer.add_megatron_args(tp)
    tp.add_argument("--nproc", type=int, default=4, help="CPU ranks to start")
    ta = tp.parse_args(train_args)
    cfg = trainer.config_from_args(ta)
    cfg.quiet = True
    import megatron.core  # noqa: F401  - import once, then fork ranks

    losses = trainer.run(cfg, ta.nproc)["losses"]
    if a.update:
        write_golden(a.golden, losses)
        print(f"wrote {len(losses)} golden values to {a.golden} (exact on {kernels()} only)")
        return 0
    golden = read_golden(a.golden)
    problems = compare(golden, losses, a.rtol, exact=cfg.deterministic)
    for step, v in enumerate(losses, 1):
        want = golden.get(step)
        print(f"step {step:>4}: lm loss {v:.8f}" + (f"  golden {want:.8f}" if want is not None else ""))
    worst = max_rel_diff(golden, losses)
    if problems:
        print("REGRESSION:\n  " + "\n  ".join(problems))
        if cfg.deterministic:
            print(f"  (exact comparison: golden values made on other kernels than {kernels()} differ by round-off)")
        return 1
    print(f"OK: {len(golden)} steps match ({'exact' if cfg.deterministic else f'rtol {a.rtol}'}; "
          f"max rel diff {worst:.3e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
