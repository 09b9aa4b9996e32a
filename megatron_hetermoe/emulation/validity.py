"""Whether an emulated run can be trusted: the bound on how much later a step ended than an exact
emulation would have (from every window's real work and host delay, rerun through the simulator
on the task graph), the scale auto_scale picks, and the verdict line."""
from __future__ import annotations

import dataclasses
import math

from megatron_hetermoe.config import EmulationSpec

FIX = ("rerun with a longer emulated step (bench: --step-seconds, or let it pick one: --step-seconds auto "
       "with a larger --max-step-seconds; train: --emulation-scale), with fewer ranks (a smaller "
       "cluster), or on a less loaded machine")


def _delays(windows: list[tuple], s: float, margin: float, part: str) -> list[tuple]:
    """(key, budget, delay) of each window at scale s; part: 'total', 'work' (real work over
    budget only) or 'host' (late wake-ups only)."""
    out = []
    for lane, key, wake, work, emu in windows:
        over = max(0.0, margin * work - emu * s)
        d = wake + over if part == "total" else (over if part == "work" else wake)
        out.append((key, emu * s, d))
    return out


def step_bound(ranks: list[dict], s: float, margin: float, bound) -> dict:
    """How much later than an exact emulation this step (the records of every rank) can have
    ended, at scale s, taking real work `margin` times as long: total, and its real-work and
    host-delay parts (each alone)."""
    t0_ref, end_ref = ranks[0]["t0"], ranks[0]["end"]
    skew = max(0.0, max(r["t0"] for r in ranks) - t0_ref)
    post_end = max((r["post_end"] for r in ranks if r["post_end"] is not None), default=None)
    tail = max(0.0, end_ref - (post_end if post_end is not None else max(r["lists_end"] for r in ranks)))
    out = {}
    for part in ("total", "work", "host"):
        crit = bound.critical([_delays(r["windows"], s, margin, part) for r in ranks])
        post = 0.0
        for r in ranks:
            if r["post"] is not None:
                wake, work, emu = r["post"]
                over = max(0.0, margin * work - emu * s)
                post = max(post, wake + over if part == "total" else (over if part == "work" else wake))
        out[part] = crit + post + (skew + tail if part != "work" else 0.0)
    return out


def choose_scale(ranks: list[dict], pred: float, bound, spec: EmulationSpec) -> tuple[float, dict]:
    """The smallest scale at which this (calibration) step's delay bound, with real work taken
    `work_margin` times longer, is at most target_overrun of the step; capped at
    max_step_seconds."""
    def frac(s: float) -> float:
        return step_bound(ranks, s, spec.work_margin, bound)["total"] / (pred * s)

    hi = spec.max_step_seconds / pred
    lo = min(hi, 1e-3 / pred)  # a 1 ms step
    info = {"calibration_iteration": ranks[0]["it"], "target_overrun": spec.target_overrun,
            "work_margin": spec.work_margin}
    if frac(hi) > spec.target_overrun:
        info.update(capped=True, expected_overrun=frac(hi))
        return hi, info
    if frac(lo) <= spec.target_overrun:
        info.update(capped=False, expected_overrun=frac(lo))
        return lo, info
    for _ in range(40):  # frac falls as s grows: bisection in log s
        mid = math.sqrt(lo * hi)
        if frac(mid) > spec.target_overrun:
            lo = mid
        else:
            hi = mid
    info.update(capped=False, expected_overrun=frac(hi))
    return hi, info


class _TaskGraph:
    """Critical delay of the HeterMoE task lists: the simulator run with each task lasting its
    budget plus its delay (a collective: the largest over its members), minus the simulator run
    on the budgets alone. A delay on a rank with slack is absorbed, as it was in the run."""

    def __init__(self, problems, group_ranks: list[int]):
        self.problems = problems  # SimProblem per ZP group, dedup=False
        self.index = {r: i for i, r in enumerate(group_ranks)}  # plan rank -> position in the gathered list

    def critical(self, per_rank: list[list[tuple]]) -> float:
        from megatron_hetermoe.planner.simulator import run

        rec = [{key: (b, d) for key, b, d in w} for w in per_rank]
        worst = 0.0
        for p in self.problems:
            rows = [rec[self.index[r]] for r in p.ranks]
            spans = []
            for with_delay in (True, False):
                def dur(row, t):
                    b, d = row.get(t, (0.0, 0.0))
                    return b + d if with_delay else b

                q = dataclasses.replace(
                    p, dur=[[0.0 if c else dur(rows[i], t) for t, c in zip(p.tasks[i], p.is_comm[i])]
                            for i in range(len(p.ranks))],
                    coll_dur=[max(dur(row, t) for row in rows) for t in p.coll_tasks], _flat=None)
                tr = run(q)
                spans.append(max([0.0, *tr.coll_end, *(max(e) for e in tr.end if e)]))
            worst = max(worst, spans[0] - spans[1])
        return worst


class _Bulk:
    """Critical delay of Megatron EP: every rank runs the same sequence of windows and the ranks
    meet at the end of each (at an all-to-all, or the start of a microbatch or of its backward),
    so window k ends at max over ranks of (budget + delay) instead of max of budget."""

    def critical(self, per_rank: list[list[tuple]]) -> float:
        n = {len(w) for w in per_rank}
        if len(n) != 1:  # not aligned (should not happen): every delay of every rank, in series
            return sum(d for w in per_rank for _, _, d in w)
        return sum(max(w[k][1] + w[k][2] for w in per_rank) - max(w[k][1] for w in per_rank)
                   for k in range(n.pop()))


# ---------------------------------------------------------------- the emulator


def validity_line(name: str, rep: dict | None) -> str:
    """One line on whether an emulated run's times can be trusted."""
    if rep is None:
        return f"{name}: not emulated"
    if rep.get("valid"):
        return (f"{name}: emulation valid (delays {rep['overrun']:.1%} of the step, limit "
                f"{rep['max_overrun']:.0%}; {rep['scale']:.3g} real s per emulated s)")
    return f"{name}: emulation INVALID: {rep.get('invalid_reason')}"
