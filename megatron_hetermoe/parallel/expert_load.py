"""Measuring expert loads during training (issue 46 item 1): tokens each expert received, and each
rank's compute seconds per task kind, summed on the host between log intervals and reduced over
the world once per interval.

Tokens: every SplitRoute (parallel/transport.py) is made from its counts exchange, whose result is on
the host already (the one read a (layer, microbatch) makes anyway); `SplitRoute.from_counts`
hands this rank's received counts per local expert to the rank's meter
(HeteroParallelState.load_meter). Summed over the world, each expert is counted once per ZP
group (one holder per ZP group and stage), so the totals are the tokens routed to each expert by
every attention rank. Nothing here reads a device tensor: no host synchronization is added.

Times: what a rank's TimelineRecorder holds for the step (CUDA events where the rank records
them, host timers on CPU ranks, the emulated budgets under emulation), summed per task kind by
the caller (training/logging.py), added with `add_seconds`.

`reduce` is the interval's one collective: a float64 all-reduce of [layers x experts + world x
kinds] over the world group (on the rank's device: NCCL reduces device tensors).
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from megatron_hetermoe.planner.expert_load import LoadStats
from megatron_hetermoe.vocabulary import TaskKind

# plan/tasks.py's compute task kinds
COMPUTE_KINDS = (TaskKind.A_F, TaskKind.A_B, TaskKind.X_F, TaskKind.X_B, TaskKind.E_F, TaskKind.E_B)


class ExpertLoadMeter:
    """One rank's sums since the last `reduce` (module docstring)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.L, self.E = num_layers, num_experts
        self._lock = threading.Lock()  # routes are made on a stream's worker thread or the issuer's
        self._zero()
        self.enabled = True  # off: observe nothing (forward-only passes: evaluation is not training load)

    def _zero(self) -> None:
        self.tokens = [[0] * self.E for _ in range(self.L)]
        self.seconds = dict.fromkeys(COMPUTE_KINDS, 0.0)
        self.steps = 0
        self.first_iteration: int | None = None

    def observe(self, layer: int, experts: list[int], received: list[int]) -> None:
        """This rank received `received[i]` tokens for expert `experts[i]` of MoE layer `layer`."""
        if not self.enabled:
            return
        with self._lock:
            row = self.tokens[layer]
            for e, n in zip(experts, received):
                row[e] += int(n)

    def add_seconds(self, iteration: int, by_kind: dict[str, float]) -> None:
        """One step's compute seconds per task kind on this rank (iteration: 1-based, the one logged)."""
        if self.first_iteration is None:
            self.first_iteration = iteration
        self.steps += 1
        for k, s in by_kind.items():
            if k in self.seconds:
                self.seconds[k] += s

    def reduce(self, group, device: torch.device) -> tuple[list[list[float]], list[dict[str, float]]]:
        """Collective over `group` (every rank at the same iteration): the interval's tokens per
        (layer, expert) summed over the group, and each rank's seconds per kind; starts the next
        interval."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        K = len(COMPUTE_KINDS)
        with self._lock:
            flat = [float(t) for row in self.tokens for t in row]
            mine = [self.seconds[k] for k in COMPUTE_KINDS]
            self.tokens = [[0] * self.E for _ in range(self.L)]
        # Built on the rank's device: NCCL reduces device tensors only (one host -> device copy)
        buf = torch.zeros(self.L * self.E + world * K, dtype=torch.float64, device=device)
        off = self.L * self.E + rank * K
        buf[:self.L * self.E] = torch.tensor(flat, dtype=torch.float64, device=device)
        buf[off:off + K] = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(buf, group=group)
        vals = buf.cpu().tolist()
        tokens = [vals[l * self.E:(l + 1) * self.E] for l in range(self.L)]
        base = self.L * self.E
        seconds = [{k: vals[base + r * K + i] for i, k in enumerate(COMPUTE_KINDS) if vals[base + r * K + i]}
                   for r in range(world)]
        self.seconds = dict.fromkeys(COMPUTE_KINDS, 0.0)
        return tokens, seconds

    def reduce_into(self, stats: LoadStats, last_iteration: int, group, device: torch.device) -> list[list[float]]:
        """`reduce`, added to `stats` as one interval ending at `last_iteration`; returns the
        interval's tokens."""
        first, steps = self.first_iteration or last_iteration, self.steps
        tokens, seconds = self.reduce(group, device)
        stats.add_interval(first, last_iteration, steps, tokens, seconds)
        self.steps, self.first_iteration = 0, None
        return tokens


def new_stats(plan, roles: list[str]) -> LoadStats:
    """An empty stats record for `plan`'s run (roles: each rank's)."""
    return LoadStats(plan.num_layers, plan.num_experts, list(plan.moe_layer_ids), plan.world_size, roles,
                     list(plan.gpu_types))
