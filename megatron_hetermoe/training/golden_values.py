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

from megatron_hetermoe.errors import UserError

DEFAULT_RTOL = 0.05


class GoldenValuesError(UserError, ValueError):
    """A golden-values file that cannot be read; the message names the file and what is wrong."""


def golden_dict(losses: list[float], metric: str = "lm loss", start_step: int = 1) -> dict:
    """Megatron's layout; `start_step` numbers the first loss (a run resumed at iteration 3 starts at 4)."""
    return {metric: {"start_step": start_step, "end_step": start_step + len(losses) - 1, "step_interval": 1,
                     "values": {str(start_step + i): float(v) for i, v in enumerate(losses)}}}


def write_golden(path: str | Path, losses: list[float], start_step: int = 1) -> None:
    Path(path).write_text(json.dumps(golden_dict(losses, start_step=start_step), indent=2) + "\n")


def read_golden(path: str | Path, metric: str = "lm loss") -> dict[int, float]:
    """{step: value}; GoldenValuesError for a missing, unreadable or malformed file."""
    return _metric_values(_load_golden(path), path, metric)


def _load_golden(path: str | Path):
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise GoldenValuesError(f"--golden {path}: cannot read it ({e.strerror}); give a golden-values JSON "
                                f"(hetermoe train --golden-values-out, or regress --update)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise GoldenValuesError(f"--golden {path}: not valid JSON ({e}); give a golden-values JSON "
                                f"(hetermoe train --golden-values-out, or regress --update)") from None
    return d


def _metric_values(d, path: str | Path, metric: str) -> dict[int, float]:
    if not isinstance(d, dict) or not isinstance(d.get(metric), dict) or not isinstance(d[metric].get("values"), dict):
        keys = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise GoldenValuesError(f"--golden {path}: no {metric!r} golden values (Megatron's layout: "
                                f"{{{metric!r}: {{'values': {{step: value}}}}}}; found {keys})")
    try:
        out = {int(k): float(v) for k, v in d[metric]["values"].items()}
    except (TypeError, ValueError) as e:
        raise GoldenValuesError(f"--golden {path}: {metric!r} values must map step numbers to numbers ({e})") from None
    if not out or min(out) < 1:
        raise GoldenValuesError(f"--golden {path}: {metric!r} holds no steps >= 1")
    return out


def max_rel_diff(golden: dict[int, float], losses: list[float], start_step: int = 1) -> float:
    """The largest relative difference over the steps both have (losses[0] is step start_step)."""
    return max((abs(losses[s - start_step] - v) / abs(v) if v else math.inf for s, v in golden.items()
                if start_step <= s < start_step + len(losses)), default=0.0)


def kernels() -> str:
    """Which build and ATen CPU kernels produced a run's numbers (exact golden values hold there only)."""
    import torch

    return f"torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}"


def compare(golden: dict[int, float], losses: list[float], rtol: float, exact: bool, start_step: int = 1) -> list[str]:
    """Human-readable mismatches; empty when the run matches (losses[0] is step start_step)."""
    problems = []
    last = start_step + len(losses) - 1
    if last < max(golden) or start_step > min(golden):
        problems.append(f"run has steps {start_step}..{last} but golden values cover steps "
                        f"{min(golden)}..{max(golden)}")
    for step, want in sorted(golden.items()):
        if not start_step <= step <= last:
            continue
        got = losses[step - start_step]
        if exact:
            bad = got != want
        else:
            bad = not math.isfinite(got) or abs(got - want) > rtol * abs(want)
        if bad:
            rel = abs(got - want) / abs(want) if want else float("inf")
            problems.append(f"step {step}: lm loss {got!r} vs golden {want!r} (rel diff {rel:.3e}, "
                            f"{'exact match required' if exact else f'rtol {rtol}'})")
    return problems


# ---- pretrain() runs: several metrics, read from Megatron's own tensorboard scalars ----------------
# The metrics Megatron's functional tests keep for a training run, by their tensorboard tag:
# `lm loss` every iteration, `num-zeros` with --log-num-zeros-in-grad, `iteration-time` with
# --log-timers-to-tensorboard (from the second iteration: the first holds the start-up).
PRETRAIN_METRICS = ("lm loss", "num-zeros", "iteration-time")
# Compared by default: the numbers a change to the model or its parallelism moves. Iteration time is
# kept (the machine's, in seconds) and compared only when a tolerance is given for it.
DEFAULT_METRIC_RTOL = {"lm loss": DEFAULT_RTOL, "num-zeros": DEFAULT_RTOL}


def scalars_from_tensorboard(tb_dir: str | Path,
                             metrics: tuple[str, ...] = PRETRAIN_METRICS) -> dict[str, dict[int, float]]:
    """{metric: {iteration: value}} from the tensorboard events Megatron's training_log wrote (float32
    values, unlike its 7-digit log lines); a metric the run did not log is left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(tb_dir).is_dir():
        raise GoldenValuesError(f"--tensorboard {tb_dir}: no such directory; give the run's --tensorboard-dir")
    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags().get("scalars", []))
    if "lm loss" not in tags:
        raise GoldenValuesError(f"--tensorboard {tb_dir}: no 'lm loss' scalars (found {sorted(tags)}); give the "
                                f"--tensorboard-dir of a finished pretrain() run")
    return {m: {e.step: float(e.value) for e in ea.Scalars(m)} for m in metrics if m in tags}


def golden_from_scalars(scalars: dict[str, dict[int, float]]) -> dict:
    """Megatron's layout for each metric (steps as logged; step_interval from the first two)."""
    out = {}
    for metric, values in scalars.items():
        steps = sorted(values)
        out[metric] = {"start_step": steps[0], "end_step": steps[-1],
                       "step_interval": steps[1] - steps[0] if len(steps) > 1 else 1,
                       "values": {str(s): values[s] for s in steps}}
    return out


def read_golden_metrics(path: str | Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} for every metric of a golden-values file ('lm loss' required)."""
    d = _load_golden(path)  # read once, every metric checked as read_golden checks 'lm loss'
    golden = {"lm loss": _metric_values(d, path, "lm loss")}
    golden.update({metric: _metric_values(d, path, metric) for metric in d if metric != "lm loss"})
    return golden


def compare_metrics(golden: dict[str, dict[int, float]], run: dict[str, dict[int, float]],
                    rtol: dict[str, float]) -> list[str]:
    """Mismatches of a run against golden values, metric by metric: each metric given a tolerance must
    be in the run at every golden step, within it (relative; 0 is exact)."""
    problems = []
    for metric, want in sorted(golden.items()):
        if metric not in rtol:
            continue
        got = run.get(metric)
        if got is None:
            problems.append(f"{metric}: not in the run (golden values have it; log it: num-zeros needs "
                            f"--log-num-zeros-in-grad, iteration-time --log-timers-to-tensorboard)")
            continue
        missing = sorted(set(want) - set(got))
        if missing:
            problems.append(f"{metric}: the run has no step {missing[0]} (golden steps {min(want)}..{max(want)}, "
                            f"run steps {min(got)}..{max(got)})")
        for step in sorted(set(want) & set(got)):
            a, b = got[step], want[step]
            bad = a != b if rtol[metric] == 0 else not math.isfinite(a) or abs(a - b) > rtol[metric] * abs(b)
            if bad:
                rel = abs(a - b) / abs(b) if b else float("inf")
                problems.append(f"step {step}: {metric} {a!r} vs golden {b!r} (rel diff {rel:.3e}, "
                                f"{'exact match required' if rtol[metric] == 0 else f'rtol {rtol[metric]}'})")
    return problems
