"""The GPU check's judgements, as pure functions of what the runs left behind (losses, per-rank
reports, logs): no process, no torch, so tests/tools/test_gpu_check.py checks each on made-up
inputs in milliseconds. The numbers that set a bound are measured; each says where."""
from __future__ import annotations

import json
import math
import re
from enum import Enum
from pathlib import Path


class Status(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"

    def __str__(self) -> str:
        return self.value


# fp32 losses of the same 4-rank run on two kernels (GPU vs CPU ranks; in --dry-run the machine's
# CPU kernels vs ATEN_CPU_CAPABILITY=default). Two CPU kernels gave bitwise equal losses on this
# check's zebra 2+2 run (6 steps; the dry run prints the difference), so the bound is the largest
# fp32 round-off measured in this project between two summation orders of one run: 4.8e-7
# (Megatron-LM's pretrain() vs the plugin's trainer on default/avx2/avx512 kernels,
# tests/training/test_megatron_lm_pretrain.py), x5 = 2.4e-6, rounded up.
FP32_REL = 3e-6
# 16-bit runs GPU vs CPU: a sanity bound only (bf16/fp16 kernels round differently per device;
# Megatron-LM's pretrain() vs the plugin's trainer on one CPU differ by up to 8.9e-5, see
# tests/megatron_lm_run.py TOL_16).
LOOSE_REL = 5e-2
# Megatron-LM's iteration line, as tests/megatron_lm_run.py reads it.
ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
# A user's error in a rank's output (errors.py: one line, no traceback): the plugin CLI's
# `error: rank N: ...`, or argparse's `PROG: error: ...`.
USER_ERROR = re.compile(r"^(?:error: rank \d+: |[\w .-]+: error: )(.*)$")
# Any error: a user's, or an exception's last line.
ERROR_LINE = re.compile(r"^(?:error: rank \d+: |[\w .-]+: error: |[\w.]*(?:Error|Exception): )(.*)$")


def losses_from_golden(path: Path) -> list[float] | None:
    """Per-step losses from Megatron golden values (hetermoe train --golden-values-out), in step
    order; None when absent or unreadable."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    vals = d.get("lm loss", {}).get("values", {})
    return [float(vals[k]) for k in sorted(vals, key=int)] or None


def losses_from_log(text: str) -> dict[int, float]:
    """Megatron-LM's per-iteration lm loss from its iteration lines (7 significant digits)."""
    return {int(i): float(v) for i, v in ITERATION.findall(text)}


def finite(xs) -> bool:
    return bool(xs) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def rel_diffs(a: list[float], b: list[float]) -> list[float]:
    """Per-step |a - b| / |b|; a and b must be the same length (a missing step is not a match)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} steps vs {len(b)} steps")
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


def fmt(xs, f: str = ".3g") -> str:
    return "[" + ", ".join(format(x, f) for x in xs) + "]"


def compare_losses(name: str, got: list[float] | None, ref: list[float] | None, bound: float,
                   got_label: str = "GPU", ref_label: str = "CPU") -> tuple[bool, str]:
    """(within bound, one line): the largest per-step relative difference of two runs' losses."""
    if not finite(got) or not finite(ref):
        return False, f"{name}: no finite losses to compare ({got_label} {got}, {ref_label} {ref})"
    try:
        d = rel_diffs(got, ref)
    except ValueError as e:
        return False, f"{name}: {got_label} vs {ref_label}: {e}"
    ok = max(d) <= bound
    return ok, f"{name}: {got_label} vs {ref_label} max rel diff {max(d):.2e} ({'<=' if ok else '>'} {bound:g})"


def refusal(output: str, flag: str) -> str | None:
    """The error line of a run that refused `flag` by name (a user's error naming it), or None."""
    for line in output.splitlines():
        m = USER_ERROR.match(line.strip())
        if m and flag in m.group(1):
            return m.group(1).strip()
    return None


def first_error(output: str) -> str | None:
    """The first user-error line of a run's output (None when it has none)."""
    for line in output.splitlines():
        m = ERROR_LINE.match(line.strip())
        if m:
            return m.group(1).strip()[:300]
    return None


def same_on_every_rank(reports: dict[int, dict], key: str) -> tuple[bool, str]:
    """Whether every rank's train_hetero report has the same `key` (a loss-scale trajectory, the
    skipped steps); the line says which rank differs."""
    if not reports:
        return False, f"{key}: no rank reported"
    missing = [r for r, d in sorted(reports.items()) if key not in (d.get("train_hetero") or {})]
    if missing:
        return False, f"{key}: ranks {missing} did not report"
    vals = {r: d["train_hetero"][key] for r, d in sorted(reports.items())}
    first = next(iter(vals.values()))
    odd = {r: v for r, v in vals.items() if v != first}
    if odd:
        return False, f"{key} differ across ranks: " + "; ".join(f"rank {r}: {v}" for r, v in vals.items())
    return True, f"{key} the same on all {len(vals)} ranks: {first}"


def dtypes_by_role(reports: dict[int, dict], roles: dict[int, str], want: dict[str, str]) -> tuple[bool, str]:
    """Every rank's parameters in its role's dtype (want: role -> 'torch.bfloat16' ...)."""
    bad, seen = [], {}
    for r, d in sorted(reports.items()):
        got = (d.get("train_hetero") or {}).get("param_dtypes")
        seen.setdefault(roles[r], set()).add(tuple(got or ()))
        if got != [want[roles[r]]]:
            bad.append(f"rank {r} ({roles[r]}): {got}, want [{want[roles[r]]}]")
    if len(reports) != len(roles):
        bad.append(f"{len(reports)} of {len(roles)} ranks reported")
    line = "; ".join(f"{role}: {sorted(v)}" for role, v in sorted(seen.items()))
    return not bad, ("parameter dtypes per role " + line) if not bad else "parameter dtypes wrong: " + "; ".join(bad)


def resumed_bitwise(full: list[float] | None, resumed: list[float] | None, from_step: int) -> tuple[bool, str]:
    """A run resumed after step `from_step` gives the uninterrupted run's later steps bit for bit."""
    if not finite(full) or not finite(resumed):
        return False, f"no losses to compare (uninterrupted {full}, resumed {resumed})"
    want = full[from_step:]
    if len(resumed) != len(want):
        return False, f"resumed run has {len(resumed)} steps, want {len(want)} (steps {from_step + 1}..{len(full)})"
    diff = [i + from_step + 1 for i, (a, b) in enumerate(zip(resumed, want)) if a != b]
    if diff:
        worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, want))
        return False, f"steps {diff} differ from the uninterrupted run (max rel {worst:.2e})"
    return True, f"steps {from_step + 1}-{len(full)} bitwise the uninterrupted run's"


def stage_message_bytes(hidden: int, seq: int, micro_batch: int, bytes_per: int = 4) -> int:
    """A pipeline-stage message: one microbatch's activations [seq, micro_batch, hidden]."""
    return hidden * seq * micro_batch * bytes_per


def per_layer(count: int, iterations: int) -> float:
    return count / max(iterations, 1)
