"""Golden values in Megatron's CI layout: write, read and compare per-step lm loss.

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

import json
import math
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
