"""Emulate a mixed GPU cluster on CPU ranks, and know when the emulation is not to be trusted.

Each rank gets the GPU type of its position in a cluster file. Every compute task runs its real
computation on the small model, then waits until the time the cost model gives for the
*emulated* model shape on that GPU type has passed; every transfer likewise waits for its bytes
over the emulated links. All times are multiplied by `scale` (real seconds per emulated
second). The same rules time plain Megatron EP, through hooks on megatron-core's modules
(attention, experts, output layer) and its token all-to-all, so HeterMoE and the baselines are
measured alike, and each can be compared with the simulator's prediction for the same plan.

Validity. Emulation holds only while the real work fits inside the emulated time. Each window
(a compute task, a transfer, the post-step, a Megatron EP segment) begins when it could, as in
the simulator: when its inputs were there and its lane free (a collective: when its last member
could begin it); everything the host does from then on (reaching the task, the real compute or
gloo call) runs inside its budget (emulated seconds x scale), and the window closes when the
budget has passed. Each rank records every window: its start, budget, when its real work ended
and when it closed. A window's *delay* is what it added over an exact emulation: the real work
that overran the budget, and a late wake-up:
    delay = max(0, real_end - (start + budget)) + (end - max(start + budget, real_end)).
The simulator, run on the task graph with each task lasting its budget plus its delay, minus the
same run on the budgets alone, gives how much later the task lists ended than an exact emulation
would have (for Megatron EP, whose ranks meet at every stage boundary, the sum over windows of
the latest rank's budget plus delay, minus the longest budget); with the post-step's delay and
the step-level slack (ranks starting the step apart, the loss all-reduce after the post-step)
this bounds how much later the step ended. A run whose bound exceeds `max_overrun` (3 %) of the
predicted step is *invalid*: its times say more about the host's CPUs than about the emulated
cluster, and it names the fix.

Scale. With `auto_scale`, the ranks run a warm-up step at the initial scale, stretch the next
one (the calibration step) so that each rank's real work fills at most a quarter of it, measure
there each window's real work and host delay, and pick the smallest scale at which the bound,
with the real work taken 1.5x longer (load varies), stays under `target_overrun` (1 %) of the
step; every later step runs at that scale.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import threading
import time
from typing import Callable

import torch

from megatron_hetermoe.config import EmulationSpec, ModelConfig
from megatron_hetermoe.emulation.clock import sleep_until
from megatron_hetermoe.parallel.device import rank_device
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import (
    CostModel,
    TrainSettings,
    runtime_program,
)
from megatron_hetermoe.planner.profiles import load_profiles

FIX = ("rerun with a longer emulated step (bench: --step-seconds, or let it pick one: --step-seconds auto "
       "with a larger --max-step-seconds; train: --emulation-scale), with fewer ranks (a smaller "
       "cluster), or on a less loaded machine")


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
        self.cur = {"it": it, "t0": t0, "scale": self.scale, "windows": [], "busy": 0.0, "lists_end": t0,
                    "post": None, "post_end": None, "end": None}
        if self.on_step_begin is not None:
            self.on_step_begin(t0)

    def _start_run(self) -> None:
        """What keeps an emulated rank's host delays small, for the run (report() undoes it)."""
        # A thread woken by a collective or a timer waits for the GIL up to the switch interval
        # (5 ms by default): a host delay on every handoff between the stream threads and the
        # main thread. Emulated ranks hand over often; a short interval keeps those delays small.
        old = sys.getswitchinterval()
        sys.setswitchinterval(min(old, 2e-4))
        self._restore.append(lambda: sys.setswitchinterval(old))
        # A full garbage collection of megatron's and torch's objects takes 0.1-1 s and would
        # land in some window at random: none during a step, one in each post-step window
        # (inside its budget), and the objects alive after the first step frozen out of it.
        if gc.isenabled():
            gc.disable()
            self._restore.append(gc.enable)
        self._niceness = _raise_priority()
        if self._niceness is not None:
            self._restore.append(lambda: _set_niceness(self._niceness[0]))

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
            b = step_bound(ranks, s, 1.0, self.bound)
            step_s = ranks[0]["end"] - ranks[0]["t0"]
            per_step.append({
                "iteration": ranks[0]["it"], "scale": s, "step_s": step_s, "emulated_step_s": step_s / s,
                "overrun_s": b["total"] / s, "overrun": b["total"] / (self.pred * s),
                "work_overrun": b["work"] / (self.pred * s), "host_delay": b["host"] / (self.pred * s),
                "busy": [min(1.0, r["busy"] / max(step_s, 1e-12)) for r in ranks]})
        first = self.first_it if self.first_it is not None else 0
        after = first + (spec.calibrate_step if spec.auto_scale else 0)
        steady = [i for i, p in enumerate(per_step) if p["iteration"] > after] or \
            ([len(per_step) - 1] if per_step and not spec.auto_scale else [])
        out = {"predicted_step_s": self.pred, "scale": self.scale, "initial_scale": spec.scale,
               "niceness": None if self._niceness is None else self._niceness[1],
               "calibration": self.calibration, "max_overrun": spec.max_overrun, "steps": per_step,
               "steady_steps": [per_step[i]["iteration"] for i in steady], **self.describe}
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


NICE_ENV = "HETERMOE_EMULATION_NICE"


def _set_niceness(value: int) -> None:
    """Set the niceness of every thread of this process (Linux keeps one per thread; threads
    started later inherit their creator's)."""
    import os

    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:
            pass


def _raise_priority() -> tuple[int, int] | None:
    """An emulated rank sleeps most of its time and must wake on time: give its threads a higher
    scheduling priority (niceness $HETERMOE_EMULATION_NICE, default -10; 0 or unset permission:
    unchanged), so that a wake-up preempts background work instead of queueing behind it.
    Returns (old, new) niceness, or None when unchanged."""
    import os

    try:
        target = int(os.environ.get(NICE_ENV, "-10"))
        old = os.getpriority(os.PRIO_PROCESS, 0)
    except (ValueError, OSError):
        return None
    if target >= old:
        return None
    try:
        _set_niceness(target)
    except (PermissionError, OSError):
        try:
            _set_niceness(old)
        except OSError:
            pass
        return None
    return old, target


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
class Emulator:
    def __init__(self, spec: EmulationSpec):
        self.spec = spec
        self.cluster = Cluster.load(spec.cluster)
        self.model = ModelConfig.load(spec.model).replace(seq_length=spec.seq_len)
        self.profiles = load_profiles(set(self.cluster.gpu_types()))
        self.cost = CostModel(self.model, self.profiles, TrainSettings(spec.seq_len, spec.activation_checkpointing))

    def gpu(self, rank: int) -> str:
        return self.cluster.gpu_types()[rank]

    def programs(self, recompute: bool = False) -> dict:
        """Which program the times are for (per GPU type), and which one the CPU ranks really run."""
        return {"predicted_program": self.cost.programs(), "runtime_program": runtime_program(recompute).describe()}

    def check_real_model(self, real: ModelConfig) -> None:
        m = self.model
        if (real.num_layers, real.num_experts, real.moe_router_topk) != (m.num_layers, m.num_experts, m.moe_router_topk):
            raise ValueError(
                f"the real model {real.name!r} has {real.num_layers} layers x {real.num_experts} experts, top-"
                f"{real.moe_router_topk}, but the emulated {m.name!r} has {m.num_layers} x {m.num_experts}, top-"
                f"{m.moe_router_topk}; emulation keeps layers and experts and shrinks only the widths: use "
                f"emulation_real_model({m.name!r})")

    def check_plan(self, plan) -> None:
        types = self.cluster.gpu_types()
        if plan.world_size != len(types):
            raise ValueError(f"plan has {plan.world_size} ranks but emulated cluster {self.cluster.name!r} has "
                             f"{len(types)}; plan for this cluster (hetermoe plan --cluster {self.cluster.name})")
        for r, (a, b) in enumerate(zip(plan.gpu_types, types)):
            if a.lower() != b.lower():
                raise ValueError(f"rank {r} is {a!r} in the plan but {b!r} in cluster {self.cluster.name!r}")

    # ---- HeterMoE --------------------------------------------------------------------------
    def task_times(self, plan, rank: int, schedule: str) -> dict:
        """Emulated seconds of each task of `rank` (not scaled)."""
        from megatron_hetermoe.planner.simulator import rank_task_times

        return dict(rank_task_times(plan, self.cost, self.cluster, self.spec.global_batch, rank, schedule))

    def hetero_clock(self, plan, schedule: str, group, recompute: bool = False) -> EmulationClock:
        """The clock of a HeterMoE rank (the same on every rank)."""
        from megatron_hetermoe.planner.simulator import build_problem

        gb = self.spec.global_batch
        post = max(build_problem(plan, self.cost, self.cluster, gb, schedule).post_step)
        problems = [build_problem(plan, self.cost, self.cluster, gb, schedule, group=g, dedup=False)
                    for g in range(len(plan.groups))]
        pred = self.predict_hetero(plan, schedule).step_time_s
        return EmulationClock(self.spec, pred, post, group, _TaskGraph(problems, list(range(plan.world_size))),
                              self.programs(recompute))

    def task_timing(self, plan, rank: int, schedule: str, clock: EmulationClock | None = None):
        """The executors' task times of `rank` (emulation/timing.py): each task's emulated time on
        the rank's GPU and links, at the clock's current scale."""
        from megatron_hetermoe.emulation.timing import EmulatedTiming

        times = self.task_times(plan, rank, schedule)
        scale = (lambda: clock.scale) if clock is not None else (lambda: self.spec.scale)
        return EmulatedTiming(lambda t: times[t] * scale(), clock)

    def predict_hetero(self, plan, schedule: str):
        from megatron_hetermoe.planner.simulator import simulate_plan

        return simulate_plan(plan, self.cost, self.cluster, self.spec.global_batch, schedule=schedule)

    # ---- plain Megatron EP ------------------------------------------------------------------
    def predict_ep(self, ranks: list[int] | None = None, name: str = "EP"):
        from megatron_hetermoe.planner.baselines import simulate_ep

        b = self.spec.global_batch if ranks is None else self.spec.global_batch * len(ranks) // self.cluster.world_size
        return simulate_ep(self.cost, self.cluster, b, ranks, name)

    def ep_clock(self, prediction, group) -> EmulationClock:
        return EmulationClock(self.spec, prediction.step_time_s, prediction.detail["post_step_s"], group, _Bulk(),
                              self.programs(False))

    def install_ep_hooks(self, gpt, rank: int, ep_group_ranks: list[int], tokens_per_microbatch: float,
                         recorder=None, clock: EmulationClock | None = None, sync_group=None) -> Callable[[], None]:
        """Time one plain Megatron EP rank as its emulated GPU; returns an undo.

        The token all-to-alls are the sync points of an EP step, so time is set per segment
        between them, as the simulator models it: (previous all-to-all or microbatch start ->
        dispatch) = attention stage l, (dispatch -> combine) = this rank's experts of layer l, each
        all-to-all = its transfer time, (last combine -> loss) = the head; backward mirrors it.
        The simulator's EP step is the sum over stages of the slowest rank's stage, so the ranks
        meet at every stage boundary: an all-to-all starts when the last rank of the EP group
        could have started it (an all-reduce of those times over `sync_group`), and so do a
        microbatch and its backward (else a rank would run ahead into a stage and wait inside it,
        in a hidden collective such as the dispatcher's token counts). Every window starts when
        its inputs were there and all real work (norms, router, permutes, the loss, the
        probabilities' all-to-all) runs inside its emulated time instead of adding to it."""
        import torch.distributed as dist
        from megatron.core.transformer.moe import token_dispatcher as td

        from megatron_hetermoe.planner.baselines import ep_a2a_time

        m, gpu, cost = self.model, self.gpu(rank), self.cost
        scale = (lambda: clock.scale) if clock is not None else (lambda: self.spec.scale)
        t = tokens_per_microbatch
        L = m.num_layers
        per_expert = len(ep_group_ranks) * t * m.moe_router_topk / m.num_experts
        n_local = gpt.decoder.layers[0].mlp.num_local_experts
        stage = [[cost.stage_time(gpu, i, t, b) for i in range(L + 1)] for b in (False, True)]
        expert = [n_local * cost.expert_time(gpu, per_expert, b) for b in (False, True)]
        a2a = ep_a2a_time(cost, self.cluster, ep_group_ranks, t) if len(ep_group_ranks) > 1 else 0.0
        hidden = gpt.config.hidden_size
        device = rank_device()  # of the all-reduces in synced()
        # last: when this rank's previous window closed (its next window's inputs are there)
        st = {"last": time.perf_counter(), "seg": 0.0, "calls": 0, "pending": None, "bseg": 0.0, "bstart": None,
              "mb": -1}
        if clock is not None:
            clock.on_step_begin = lambda t0: st.update(last=t0)

        def close(lane: str, kind: str, layer: int, start: float, budget: float) -> float:
            real_end = time.perf_counter()
            sleep_until(start + budget)
            end = time.perf_counter()
            if clock is not None:
                clock.window(lane, (kind, layer, st["mb"]), start, budget, real_end, end)
            if recorder is not None:
                recorder.record(lane, kind, layer, st["mb"], start, end)
            st["last"] = end
            return end

        def synced(ready: float) -> float:
            """When the last rank of the EP group could have started this window."""
            if sync_group is None or dist.get_world_size(sync_group) == 1:
                return ready
            x = torch.tensor([ready], dtype=torch.float64, device=device)
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=sync_group)
            return float(x.item())

        def mb_start(mod, args):
            st.update(seg=synced(st["last"]), calls=0, pending=None, mb=st["mb"] + 1)

        def bwd_call(layer: int, dispatch: bool):  # gradient of an all-to-all's output is ready
            if dispatch:
                close("compute", "E_B", layer, st["bseg"], expert[True] * scale())
            else:
                close("compute", "A_B", layer + 1, st["bseg"], stage[True][layer + 1] * scale())
            st["bstart"] = (layer, dispatch, synced(st["last"]))

        def bwd_return():  # the reverse all-to-all produced the input's gradient
            layer, dispatch, start = st["bstart"]
            st["bseg"] = close("combine" if dispatch else "dispatch", "D_B" if dispatch else "C_B", layer, start,
                               a2a * scale())

        orig = td.all_to_all

        def timed_all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None, **kw):
            # kw: megatron-core 0.19 also passes use_nccl_stream= (compat.py)
            if input_.dim() != 2 or input_.shape[-1] != hidden:
                # The probabilities ride in the dispatch's window.
                out = orig(group, input_, output_split_sizes, input_split_sizes, **kw)
                if st["pending"] is not None:
                    layer, start = st["pending"]
                    st.update(pending=None, seg=close("dispatch", "D_F", layer, start, a2a * scale()))
                return out
            k = st["calls"]
            st["calls"] = k + 1
            layer, dispatch = k // 2, k % 2 == 0
            if dispatch:
                close("compute", "A_F", layer, st["seg"], stage[False][layer] * scale())
            else:
                close("compute", "E_F", layer, st["seg"], expert[False] * scale())
            start = synced(st["last"])
            x = _Mark.apply(input_, bwd_return) if input_.requires_grad else input_
            out = orig(group, x, output_split_sizes, input_split_sizes, **kw)
            if dispatch:
                st["pending"] = (layer, start)
            else:
                st["seg"] = close("combine", "C_F", layer, start, a2a * scale())
            return _Mark.apply(out, lambda: bwd_call(layer, dispatch)) if out.requires_grad else out

        def backward_start():  # the loss's gradient reached the head; the loss ran in this window
            st["bseg"] = synced(st["last"])

        def head_done(mod, args, out):
            close("compute", "A_F", L, st["seg"], stage[False][L] * scale())
            first = out[0] if isinstance(out, tuple) else out
            first = _Mark.apply(first, backward_start)
            return (first,) + tuple(out[1:]) if isinstance(out, tuple) else first

        def embedding_done(mod, args, out):
            return _Mark.apply(out, lambda: close("compute", "A_B", 0, st["bseg"], stage[True][0] * scale()))

        handles = [gpt.embedding.register_forward_pre_hook(mb_start),
                   gpt.embedding.register_forward_hook(embedding_done),
                   gpt.output_layer.register_forward_hook(head_done)]
        td.all_to_all = timed_all_to_all

        def undo():
            td.all_to_all = orig
            for h in handles:
                h.remove()
            if clock is not None:
                clock.on_step_begin = None

        return undo


def ep_sync_groups(ep_group_ranks: list[int]):
    """One extra process group per Megatron EP group, for the all-to-all call times (collective:
    every rank passes the ranks of its own EP group); returns this rank's."""
    import torch.distributed as dist

    from megatron_hetermoe.parallel.device import group_timeout

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(ep_group_ranks))
    mine = None
    for ranks in sorted({tuple(r) for r in everyone}):
        g = dist.new_group(list(ranks), timeout=group_timeout())
        if tuple(sorted(ep_group_ranks)) == ranks:
            mine = g
    return mine


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `cb` (a stretch point inside the backward pass)."""

    @staticmethod
    def forward(ctx, x, cb):
        ctx.cb = cb
        return x.clone()  # a view would break in-place ops downstream (bias-dropout-add)

    @staticmethod
    def backward(ctx, g):
        ctx.cb()
        return g, None


def emulation_real_model(emulated: str | ModelConfig, hidden: int = 64, seq_length: int = 32) -> ModelConfig:
    """The small model that really runs while `emulated` is emulated: same layers, experts and
    top-k (the task lists and placements depend on them), tiny widths."""
    m = emulated if isinstance(emulated, ModelConfig) else ModelConfig.load(emulated)
    return m.replace(name=f"{m.name}-emulated-by-tiny", hidden_size=hidden, num_attention_heads=4,
                     ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden, vocab_size=256,
                     seq_length=seq_length)


def validity_line(name: str, rep: dict | None) -> str:
    """One line on whether an emulated run's times can be trusted."""
    if rep is None:
        return f"{name}: not emulated"
    if rep.get("valid"):
        return (f"{name}: emulation valid (delays {rep['overrun']:.1%} of the step, limit "
                f"{rep['max_overrun']:.0%}; {rep['scale']:.3g} real s per emulated s)")
    return f"{name}: emulation INVALID: {rep.get('invalid_reason')}"
