"""The closed loop, live (`--hetero-replan-interval K`, issue 46 item 4): every K steps, at a step
boundary, the ranks agree on a placement for the loads measured since the last decision and, when
it pays, move experts to it without a restart.

Each decision:
1. the interval's expert loads: the meter's one all-reduce (training/expert_load_log.py; done here
   when the log interval did not just do it), so every rank holds the same tokens per (layer,
   expert) and every rank's task seconds;
2. the first rank proposes (planner/rebalance.py: placement, hysteresis) or, in tests, the
   RunHooks.replan hook decides, and broadcasts the plan (or None): every rank moves to the same;
3. a move (training/expert_move.py): whole states by canonical name (the distributed optimizer's
   slices gathered), the moved experts' states sent point to point from their old holders to the
   new, then the rank's plan arithmetic switches to the new plan (the process groups do not
   change: same roles, same member positions) and its module, DDP, optimizer, LR schedule, NaN
   guard and task lists are rebuilt from the states (the trainer's build, training/hetero.py),
   the fp32 main parameters and Adam moments put back as they were; the checkpointer saves the
   new plan from then on.
A move changes no arithmetic (docs/expert-load.md "Live moves" says where that holds): each
expert computes on the same tokens in the same order wherever it sits.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.rebalance import (
    Proposal,
    RebalanceConfig,
    check_same_roles,
    holdings,
    moves,
    placement_key,
    propose,
)
from megatron_hetermoe.training.expert_move import (
    MoveStats,
    exchange,
    expert_of,
    load_optimizer_states,
    timed,
    whole_states,
)


class Replanner:
    """LoopParts.after_step of a HeterMoE rank with --hetero-replan-interval (module docstring).
    `rebuild(states)`: the trainer's rebuild of the rank's objects for hs's plan, returning its
    RankBuild; `moves`: a record per move made (MoveStats plus the decision), every rank alike."""

    def __init__(self, hs, run, hook: Callable[[int, HeteroPlan], HeteroPlan | None] | None, loads, role, parts,
                 rebuild: Callable[[dict], object], simulated: Callable[..., Proposal] | None = None):
        self.hs, self.hook, self.loads, self.role, self.parts, self.rebuild = hs, hook, loads, role, parts, rebuild
        # The simulator decides where it knows the cluster: an emulated run's (Emulator.replan), a
        # run on GPUs with shipped profiles (planner/rebalance.run_pricing); (plan, tokens, next
        # steps, move cost) -> Proposal. Else the measured-time rule (CPU ranks).
        self.simulated = simulated
        self.K, self.schedule = run.replan_interval, run.schedule or hs.plan.schedule
        self.cfg = RebalanceConfig(margin=run.replan_margin)
        self.capacity = holdings(hs.plan)  # memory: no rank holds more experts than the starting plan gave it
        self.frozen: set[tuple[int, int]] = set()  # moved by the last move: not moved at the next decision
        self.last = 0  # the iteration of the last decision
        self.t_last = time.perf_counter()
        self.moves: list[dict] = []
        self.stays: list[dict] = []  # the first rank's decisions not to move, with the reason
        self.measured: MoveStats | None = None
        for name in role.names.values():
            expert_of(name, hs.plan)  # refuses packed experts (GroupedMLP) before the first step

    def __call__(self, iteration: int) -> None:
        if iteration % self.K:
            return
        hs = self.hs
        if self.loads.reduced_at != iteration:
            self.loads.interval(iteration)
        step_s = (time.perf_counter() - self.t_last) / max(1, iteration - self.last)
        decision = [None]
        if hs.rank == 0:
            decision[0] = self._decide(iteration, step_s)
        dist.broadcast_object_list(decision, src=0, group=hs.group("world"))
        self.last = iteration
        got = decision[0]
        if got is not None:
            plan_dict, note = got
            self._move(HeteroPlan.from_dict(plan_dict), iteration, note)
        self.t_last = time.perf_counter()

    # ---- the decision (first rank) -----------------------------------------------------------
    def _window(self) -> tuple[list[list[float]], list[dict[str, float]], int]:
        st = self.loads.stats
        got = [iv for iv in st.intervals if iv["iterations"][0] > self.last]
        tokens = [[sum(iv["tokens"][l][e] for iv in got) for e in range(st.num_experts)] for l in range(st.num_layers)]
        seconds: list[dict[str, float]] = [{} for _ in range(st.world_size)]
        for iv in got:
            for mine, add in zip(seconds, iv["task_seconds"]):
                for k, s in add.items():
                    mine[k] = mine.get(k, 0.0) + s
        return tokens, seconds, sum(iv["steps"] for iv in got)

    def _cost(self, step_s: float) -> Callable[[int], float]:
        """Seconds to move n experts: the last move's (its fixed part, the rebuild and gather,
        plus its exchange per expert), or before any move one step's time (the target: a move
        costs less than a step)."""
        m = self.measured
        if m is None or not m.experts:
            return lambda n: step_s
        return lambda n: m.rebuild_s + m.gather_s + m.exchange_s / m.experts * n

    def _decide(self, iteration: int, step_s: float) -> tuple[dict, dict] | None:
        plan = self.hs.plan
        tokens, seconds, steps = self._window()
        if self.hook is not None:
            new = self.hook(iteration, plan)
            if new is None or placement_key(new) == placement_key(plan):
                return None
            check_same_roles(plan, new)
            prop = Proposal(new, moves(plan, new), reason="forced (RunHooks.replan)")
        else:
            prop = self.simulated(plan, tokens, self.K, self._cost(step_s)) if self.simulated is not None else propose(
                plan, tokens, seconds, steps, self.K, self._cost(step_s), self.schedule, self.capacity, self.frozen,
                self.cfg)
            if prop.plan is None:
                self.stays.append({"iteration": iteration, "reason": prop.reason,
                                   "predicted_s_now": prop.seconds_now, "predicted_s_new": prop.seconds_new})
                if not self.parts.cfg.quiet:
                    print(f" live placement at iteration {iteration}: stays ({prop.reason})", flush=True)
                return None
        note = {"iteration": iteration, "moved": [list(m) for m in prop.moved], "reason": prop.reason,
                "predicted_s_now": prop.seconds_now, "predicted_s_new": prop.seconds_new,
                "estimated_cost_s": prop.move_cost_s, "step_s": step_s}
        return prop.plan.to_dict(), note

    # ---- the move (every rank) ---------------------------------------------------------------
    def _move(self, new: HeteroPlan, iteration: int, note: dict) -> None:
        hs, role, parts = self.hs, self.role, self.parts
        old = hs.plan
        layout = hs.layout.moved_to(new)  # refused before any state moves if the pools differ
        t0 = time.perf_counter()
        states, gather_s = timed(whole_states, role.module, role.names, parts.optimizer)
        (kept, nbytes), exchange_s = timed(exchange, states, old, new, hs.rank, hs.group("world"), hs.device)
        del states
        built = getattr(role.fwd_bwd, "keywords", {}).get("built")
        if built is not None:
            built.close()  # the old task lists' executor and stream workers
        hs.layout = layout  # the same groups serve the new plan (same roles and positions)
        rng = _rng_state()
        t1 = time.perf_counter()
        rb = self.rebuild(kept)
        load_optimizer_states(rb.module, rb.names, rb.optimizer, kept)
        rebuild_s = time.perf_counter() - t1
        _set_rng_state(rng)  # building draws from the RNG; training must not see it
        took = torch.tensor([gather_s, exchange_s, rebuild_s, time.perf_counter() - t0], dtype=torch.float64,
                            device=hs.device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=hs.group("world"))
        gather_s, exchange_s, rebuild_s, total = took.tolist()
        moved = moves(old, new)
        self.measured = MoveStats(len(moved), nbytes, gather_s, exchange_s, rebuild_s, total)
        self.frozen = {(l, e) for l, e, _, _ in moved}
        self.moves.append({**note, **self.measured.as_dict()})
        if hs.rank == 0 and not parts.cfg.quiet:
            print(f" live move at iteration {iteration}: {len(moved)} expert(s) of group 0 "
                  f"({note['reason']}); {nbytes / 2**20:.2f} MiB in {total:.3f} s", flush=True)


def _rng_state() -> tuple:
    from megatron.core.tensor_parallel import random as mrandom

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, mrandom.get_cuda_rng_tracker().get_states()


def _set_rng_state(state: tuple) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cpu, cuda, tracker = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    mrandom.get_cuda_rng_tracker().set_states(tracker)
