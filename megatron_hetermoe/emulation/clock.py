"""Emulated time's one primitive, shared by the emulator and the schedule executor: wait until
a deadline on time.perf_counter() (one system-wide monotonic clock on Linux, so every rank reads
the same time)."""
from __future__ import annotations

import gc
import statistics
import threading
import time
from typing import Callable

import torch

from megatron_hetermoe.config import EmulationSpec
from megatron_hetermoe.emulation.tuning import tune_process
from megatron_hetermoe.emulation.validity import FIX, choose_scale, step_bound
from megatron_hetermoe.parallel.device import rank_device


def sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


# ---------------------------------------------------------------- the clock of one rank
class EmulationClock:
    """One rank's emulated time: the current scale, and the record of every window (module
    docstring). The trainer calls step_begin / post_step / step_end; the zebra executor and the
    Megatron EP hooks call window(); report() (collective over `group`) judges the run."""

    def __init__(self, spec: EmulationSpec, predicted_step_s: float, post_step_s: float, group, bound,
                 describe: dict | None = None):
        self.spec = spec
        self.pred = predicted_step_s  # emulated seconds
        self.post_s = post_step_s  # emulated seconds, the same on every rank
        self.group = group
        self.bound = bound  # _TaskGraph or _Bulk
        self.scale = spec.scale
        self.records: list[dict] = []
        self.cur: dict | None = None
        self.first_it: int | None = None
        self.calibration: dict | None = None
        self.describe = describe or {}
        self.on_step_begin: Callable[[float], None] | None = None  # the Megatron EP hooks' step start
        # (first iteration, predicted step, bound) of each plan the run was on: a live move
        # (follow) changes the lists, and each step is judged by its own plan's.
        self.phases: list[tuple[int | None, float, object]] = [(None, predicted_step_s, bound)]
        self._lock = threading.Lock()
        self._restore: list[Callable[[], None]] = []  # undo what _start_run changed in this process
        self._niceness: tuple[int, int] | None = None
        self.device = rank_device()  # of the all-reduce in post_step

    # ---- recording -------------------------------------------------------------------------
    @property
    def t0(self) -> float:
        return self.cur["t0"]

    def step_begin(self, it: int, t0: float) -> None:
        if self.first_it is None:
            self.first_it = it
            self._start_run()
        if self.phases[-1][0] is None:
            self.phases[-1] = (it, *self.phases[-1][1:])
        self.cur = {"it": it, "t0": t0, "scale": self.scale, "windows": [], "busy": 0.0, "lists_end": t0,
                    "post": None, "post_end": None, "end": None, "phase": len(self.phases) - 1}
        if self.on_step_begin is not None:
            self.on_step_begin(t0)

    def follow(self, predicted_step_s: float, post_step_s: float, bound) -> None:
        """From the next step on, the run is on another plan (a live move, training/replan.py):
        its predicted step, post-step and validity task graph (Emulator.hetero_phase). The scale
        stays; steps before are judged by the plan they ran."""
        self.pred, self.post_s, self.bound = predicted_step_s, post_step_s, bound
        self.phases.append((None, predicted_step_s, bound))

    def _start_run(self) -> None:
        """What keeps an emulated rank's host delays small, for the run (report() undoes it)."""
        self._niceness, restore = tune_process()
        self._restore.extend(restore)

    def window(self, lane: str, key, start: float, budget: float, real_end: float, end: float) -> None:
        """Record one window (perf_counter seconds; budget = emulated seconds x scale): it began
        at `start`, when it could (its inputs there, its lane free; a collective: when its last
        member could), its real work (and any host delay before it) ended at real_end, and it
        closed at `end`, after sleeping until start + budget."""
        wake = max(0.0, end - max(start + budget, real_end))
        w = (lane, key, wake, max(0.0, real_end - start), budget / self.cur["scale"])
        with self._lock:
            cur = self.cur
            cur["windows"].append(w)
            if lane == "compute":
                cur["busy"] += budget
            if end > cur["lists_end"]:
                cur["lists_end"] = end

    def post_step(self) -> None:
        """Gradient all-reduce + optimizer step on the emulated GPUs: from when the last rank
        finished its step's tasks (an all-reduce of that time), for the predicted post-step
        time. The real all-reduce, gradient norm and optimizer step of the CPU ranks run inside."""
        import torch.distributed as dist

        t = torch.tensor([self.cur["lists_end"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        start = float(t.item())
        gc.collect()
        real_end = time.perf_counter()
        budget = self.post_s * self.cur["scale"]
        sleep_until(start + budget)
        end = time.perf_counter()
        wake = max(0.0, end - max(start + budget, real_end))
        self.cur["post"] = (wake, max(0.0, real_end - start), self.post_s)
        self.cur["post_end"] = end

    def step_end(self, it: int, step_time_s: float) -> None:
        """Close the step. With auto_scale (collective over the group): after the step before the
        calibration step, a first scale at which each rank's real work fills at most
        `calibration_duty` of the step (the calibration step then runs under the load the
        measured steps will see, not with every rank busy); after the calibration step, the
        scale (choose_scale)."""
        self.cur["end"] = self.cur["t0"] + step_time_s
        self.records.append(self.cur)
        if len(self.records) == 1:
            gc.freeze()
        if not self.spec.auto_scale or self.calibration is not None:
            return
        k = it - self.first_it
        if k >= self.spec.calibrate_step:
            self._calibrate(self._gather([self.cur])[0])
        elif k == self.spec.calibrate_step - 1:
            ranks = self._gather([self.cur])[0]
            work = max(sum(w[3] for w in r["windows"] if w[0] == "compute") + (r["post"][1] if r["post"] else 0.0)
                       for r in ranks)
            self.scale = min(max(self.scale, work / (self.spec.calibration_duty * self.pred)),
                             self.spec.max_step_seconds / self.pred)

    # ---- analysis --------------------------------------------------------------------------
    def _gather(self, records: list[dict]) -> list[list[dict]]:
        """[step][rank] records of every rank (collective)."""
        import torch.distributed as dist

        n = dist.get_world_size(self.group)
        got: list = [None] * n
        dist.all_gather_object(got, records, group=self.group)
        return [[got[r][i] for r in range(n)] for i in range(len(records))]

    def _calibrate(self, ranks: list[dict]) -> None:
        s, info = choose_scale(ranks, self.pred, self.bound, self.spec)
        info["from_scale"] = self.scale
        self.calibration = info
        self.scale = s

    def report(self) -> dict:
        """Judge the run (collective over the group; the same result on every rank)."""
        gc.unfreeze()
        while self._restore:
            self._restore.pop()()
        steps = self._gather(self.records)
        spec = self.spec
        per_step = []
        for ranks in steps:
            s = ranks[0]["scale"]
            _, pred, bound = self.phases[ranks[0]["phase"]]
            b = step_bound(ranks, s, 1.0, bound)
            step_s = ranks[0]["end"] - ranks[0]["t0"]
            per_step.append({
                "iteration": ranks[0]["it"], "scale": s, "step_s": step_s, "emulated_step_s": step_s / s,
                "predicted_step_s": pred, "overrun_s": b["total"] / s, "overrun": b["total"] / (pred * s),
                "work_overrun": b["work"] / (pred * s), "host_delay": b["host"] / (pred * s),
                "busy": [min(1.0, r["busy"] / max(step_s, 1e-12)) for r in ranks]})
        first = self.first_it if self.first_it is not None else 0
        after = first + (spec.calibrate_step if spec.auto_scale else 0)
        steady = [i for i, p in enumerate(per_step) if p["iteration"] > after] or \
            ([len(per_step) - 1] if per_step and not spec.auto_scale else [])
        out = {"predicted_step_s": self.pred, "scale": self.scale, "initial_scale": spec.scale,
               "niceness": None if self._niceness is None else self._niceness[1],
               "calibration": self.calibration, "max_overrun": spec.max_overrun, "steps": per_step,
               "steady_steps": [per_step[i]["iteration"] for i in steady],
               "phases": [{"from_iteration": it, "predicted_step_s": p} for it, p, _ in self.phases], **self.describe}
        if not steady:
            out.update(valid=False, overrun=None, measured_step_s=None, utilization=[],
                       invalid_reason="no step ran after the calibration step; run more steps")
            return out
        st = [per_step[i] for i in steady]
        over = statistics.median_high([p["overrun"] for p in st])
        med = sorted(st, key=lambda p: p["overrun"])[len(st) // 2]  # the step whose overrun is `over`
        ranks = steps[per_step.index(med)]
        worst = sorted(((max(0.0, w[3] - w[4] * med["scale"]) + w[2], r, w[0], repr(w[1]), w[2],
                         max(0.0, w[3] - w[4] * med["scale"])) for r, rec in enumerate(ranks) for w in rec["windows"]),
                       reverse=True)[:8]
        out["worst_windows"] = [{"rank": r, "lane": lane, "task": key, "host_delay_s": f, "work_over_s": o}
                                for _, r, lane, key, f, o in worst]
        out["measured_step_s"] = statistics.median(p["emulated_step_s"] for p in st)
        out["overrun"] = over
        out["utilization"] = [statistics.median(p["busy"][r] for p in st) for r in range(len(st[0]["busy"]))]
        out["valid"] = over <= spec.max_overrun
        out["invalid_reason"] = None if out["valid"] else (
            f"the emulation overran: real work and host delays added up to {over:.1%} of the step "
            f"(limit {spec.max_overrun:.0%}; real work over the emulated time {med['work_overrun']:.1%}, "
            f"host delays {med['host_delay']:.1%}) at {self.scale:.3g} real s per emulated s"
            + (" (the largest auto scale allows; --max-step-seconds)" if self.calibration and
               self.calibration.get("capped") else "") + f"; {FIX}")
        return out
