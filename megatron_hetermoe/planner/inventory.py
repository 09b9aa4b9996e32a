"""The GPUs a job has, and the plan the planner's search picks for them (`--hetero-plan auto`).

An Inventory is a GPU type (a profile name, configs/gpus/) and a node per rank, in rank order.
It comes from what the job finds at start under torchrun (each rank's CUDA device's profile, or on
a CPU rank the type its node emulates, $HETERMOE_GPU_TYPE; training/elastic.gather_inventory:
`from_ranks`), or from what the user gives (`--hetero-gpus`: a
cluster config, as `hetermoe plan --cluster` takes, or a list of GPU types: `from_spec`), or from a
plan's GPU types. `auto_plan` runs the planner's search for
the inventory with the run's model, batch and layout flags fixed, so the plan it returns is one the
run accepts; elastic restarts (training/elastic.py) call it again for the survivors (`without`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.errors import UserError
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.cluster import Cluster, NodeGroup
from megatron_hetermoe.planner.profiles import known_gpu_types


class InventoryError(UserError, ValueError):
    """An inventory that names no known GPU, or one the model does not fit."""


GPU_TYPE_ENV = "HETERMOE_GPU_TYPE"  # a CPU rank's emulated GPU type (there is no device to ask)

@dataclass(frozen=True)
class Inventory:
    gpu_types: tuple[str, ...]  # per rank
    nodes: tuple[int, ...]  # per rank: ranks on one node share its NICs
    nic_gbps: float = 100.0

    def __post_init__(self):
        if len(self.gpu_types) != len(self.nodes):
            raise ValueError(f"inventory of {len(self.gpu_types)} GPU types but {len(self.nodes)} nodes")
        unknown = sorted(set(self.gpu_types) - set(known_gpu_types()))
        if unknown:
            raise InventoryError(f"GPU type(s) {unknown} have no profile; use types from {known_gpu_types()}")

    @property
    def size(self) -> int:
        return len(self.gpu_types)

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> "Inventory":
        return cls(tuple(cluster.gpu_types()), tuple(cluster.node_of()), cluster.node_groups[0].nic_gbps_per_gpu)

    @classmethod
    def from_spec(cls, spec: str) -> "Inventory":
        """--hetero-gpus: a cluster config (a path or a name in configs/clusters/), or GPU types in
        rank order, comma-separated, each optionally counted ("4xA40,4xV100-16GB"); a node per run
        of one type (at most 8 GPUs)."""
        if "," not in spec and not re.match(r"\d+x", spec) and spec not in known_gpu_types():
            try:
                return cls.from_cluster(Cluster.load(spec))
            except (FileNotFoundError, ValueError) as e:
                raise InventoryError(f"--hetero-gpus {spec!r}: not a cluster config ({e}) nor a list of GPU "
                                     f"types like 4xA40,4xV100-16GB") from None
        types: list[str] = []
        for item in (x.strip() for x in spec.split(",") if x.strip()):
            count, sep, gpu = item.partition("x")
            if sep and count.isdigit():
                types += [gpu] * int(count)
            else:
                types.append(item)
        if not types:
            raise InventoryError(f"--hetero-gpus {spec!r} names no GPU")
        return cls.from_types(types)

    @classmethod
    def from_types(cls, types: list[str]) -> "Inventory":
        """GPU types in rank order (a spec's, or a plan's): a node per run of one type (at most 8)."""
        return cls.from_cluster(Cluster.from_gpu_types("given", list(types)))

    @classmethod
    def from_ranks(cls, ranks: list[tuple[str, str]]) -> "Inventory":
        """From each rank's (GPU type, host name), in rank order: a node per host."""
        hosts: dict[str, int] = {}
        return cls(tuple(t for t, _ in ranks), tuple(hosts.setdefault(h, len(hosts)) for _, h in ranks))

    def without(self, ranks: list[int]) -> "Inventory":
        """The inventory after losing `ranks` (their GPUs); the survivors keep their order."""
        keep = [r for r in range(self.size) if r not in set(ranks)]
        return Inventory(tuple(self.gpu_types[r] for r in keep), tuple(self.nodes[r] for r in keep), self.nic_gbps)

    def cluster(self, name: str = "inventory") -> Cluster:
        """As the planner's Cluster: a node group per run of ranks on one node."""
        groups: list[NodeGroup] = []
        i = 0
        while i < self.size:
            j = i
            while j < self.size and (self.nodes[j], self.gpu_types[j]) == (self.nodes[i], self.gpu_types[i]):
                j += 1
            groups.append(NodeGroup(self.gpu_types[i], 1, j - i, self.nic_gbps))
            i = j
        return Cluster(name, tuple(groups))

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for t in self.gpu_types:
            counts[t] = counts.get(t, 0) + 1
        return " + ".join(f"{n} {t}" for t, n in counts.items())


@dataclass(frozen=True)
class AutoPlanRun:
    """What the run fixes for the search: its model, batch and layout flags."""
    model: ModelConfig
    seq_length: int
    global_batch_size: int
    micro_batch_size: int
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    distributed_optimizer: bool = False
    schedule: str | None = None  # --hetero-schedule: the pick must run it (None: either)
    context_parallel: int = 1  # --context-parallel-size: the attention members' CP size the search keeps


def _search(run: AutoPlanRun, inventory: Inventory):
    from megatron_hetermoe.planner.search import search

    return search(run.model, inventory.cluster(), run.seq_length, run.global_batch_size,
                  attention_tp=(run.tensor_parallel,), pipeline_stages=(run.pipeline_stages,),
                  attention_cp=(run.context_parallel,),
                  micro_batch_size=run.micro_batch_size, distributed_optimizer=run.distributed_optimizer,
                  pick_schedules=(run.schedule,) if run.schedule else None, baselines=False)


def auto_plan(run: AutoPlanRun, inventory: Inventory, max_idle: int = 2) -> tuple[HeteroPlan, list[int]]:
    """The planner's pick for `inventory` with the run's model, batch and layout, and the GPUs it
    uses: plan rank i runs on inventory rank kept[i] (the first ranks of each type, in order).
    Where no plan uses every GPU (the batch does not split over the attention ranks they give,
    say 8 sequences over 3), up to
    `max_idle` GPUs are left idle, the fewest that give a plan, the fastest predicted step among
    those. InventoryError naming what is missing when nothing fits."""
    res = _search(run, inventory)
    idx = tuple(range(inventory.size))
    best = (res, idx) if res.plan is not None else None
    tried = {idx}
    for _ in range(max_idle):
        if best is not None:
            break
        found = []
        for kept in sorted(tried):
            for t in dict.fromkeys(inventory.gpu_types[i] for i in kept):
                last = max(i for i in kept if inventory.gpu_types[i] == t)
                sub = tuple(i for i in kept if i != last)
                if sub and sub not in tried:
                    tried.add(sub)
                    r = _search(run, inventory.without([i for i in idx if i not in sub]))
                    if r.plan is not None:
                        found.append((r.predictions[0].step_time_s, sub, r))
        if found:
            _, sub, r = min(found, key=lambda x: (x[0], x[1]))
            best = (r, sub)
    if best is None:
        why = "; ".join(f"{p.name}: {p.detail.get('reason', p.detail)}" for p in res.predictions
                        if not p.fits and p.detail)[:600]
        raise InventoryError(
            f"no HeterMoE plan for model {run.model.name!r} (global batch {run.global_batch_size}, micro batch "
            f"{run.micro_batch_size}, TP {run.tensor_parallel}, PP {run.pipeline_stages}) on {inventory.size} GPUs "
            f"({inventory.describe()}), nor with up to {max_idle} of them idle: {why or 'no layout fits'}; add "
            f"GPUs, or change the batch or layout flags")
    res, kept = best
    plan = res.plan
    plan.meta = {**(plan.meta or {}), "made_by": "--hetero-plan auto",
                 "inventory": [inventory.gpu_types[i] for i in kept], "idle_gpus": inventory.size - len(kept)}
    return plan, list(kept)
