"""The "hetero" parallel dimension: process groups built from a plan.

Megatron's RankGenerator knows tp/cp/ep/dp/pp only, so HeterMoE builds its own groups and
hands modules an explicit ProcessGroupCollection. Every rank creates every group in the same
order (torch's new_group is collective over the world). A rank's role is read from the plan
once, here; everything downstream reads it from HeteroParallelState.

Groups, per the paper's placement:
- dispatch group / combine group (one pair per ZP group, members = its attention + expert
  ranks): all-to-all in the attention->expert and expert->attention directions. Each group
  carries one direction only (forward dispatch and the gradient of combine go attention->expert
  on `dispatch`; forward combine and the gradient of dispatch go expert->attention on `combine`),
  so the two can be in flight at once.
- counts group (same members): the single issuer's counts exchanges (schedules/issuer.py), so
  the split sizes of a dispatch travel ahead of the payloads queued on the dispatch group.
- attention DP group: every attention rank of every ZP group (replicas of the dense weights).
- replica group: the k-th member of every ZP group (replicas of the experts that member holds).
- world group: every rank, for the global gradient norm and step-wide agreement.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_hetermoe.config import Role
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup


@dataclass
class HeteroParallelState:
    plan: HeteroPlan
    rank: int
    role: Role
    group_index: int
    member_index: int  # position of this rank in its ZP group's members (attention first)
    attention_dp_rank: int | None  # data-parallel rank among all attention ranks
    dispatch_group: dist.ProcessGroup
    combine_group: dist.ProcessGroup
    counts_group: dist.ProcessGroup
    attention_dp_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup
    self_group: dist.ProcessGroup
    world_group: dist.ProcessGroup
    # Where every tensor this rank's plugin code allocates lives; worker threads read it
    # here, never from torch.cuda.current_device().
    device: torch.device = torch.device("cpu")
    # The dtype tokens cross roles in, the same on every rank (config.PoolPrecision.wire);
    # None: each rank's params_dtype, one precision on every rank.
    wire_dtype: torch.dtype | None = None

    @property
    def zp(self) -> ZPGroup:
        return self.plan.groups[self.group_index]

    @property
    def num_attention_per_group(self) -> int:
        return len(self.zp.attention_ranks)

    @property
    def comm_order(self) -> list[int]:
        """The ZP group's ranks in the order all-to-all split sizes refer to them: torch numbers
        a group's members by ascending global rank, whatever order the plan lists them in."""
        return sorted(self.zp.members)

    def layer_order(self, layer: int) -> list[int]:
        """Expert ids of `layer` in the order they travel: holder by holder in comm_order, ids
        ascending."""
        pl = self.zp.placement[layer]
        return [e for r in self.comm_order for e in pl.get(r, [])]

    def local_experts(self, layer: int) -> list[int]:
        return list(self.zp.placement[layer].get(self.rank, []))

    def received_counts(self, layer: int, all_counts: torch.Tensor) -> torch.Tensor:
        """[member, local expert] token counts this rank receives, from the counts exchange's
        [member, expert in layer_order] result (no columns when it holds no expert)."""
        order = self.layer_order(layer)
        return all_counts[:, [order.index(e) for e in self.local_experts(layer)]]

    def owns_gradient(self, is_expert: bool) -> bool:
        """Whether this rank counts a gradient it holds in the world's gradient norm, so that each
        distinct parameter is counted exactly once: a dense parameter (replicated on every
        attention rank) by attention DP rank 0; an expert (replicated across ZP groups, on an
        expert rank or, with Asym-EA, an attention rank) by its holder in ZP group 0."""
        if is_expert:
            return self.group_index == 0
        return self.attention_dp_rank == 0

    def pg_collection(self):
        """ProcessGroupCollection for megatron-core modules on this rank: every model-parallel
        dimension is this rank alone; data parallelism is the attention DP group (attention
        ranks) or the expert replica group (expert ranks)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        one = self.self_group
        dp = self.attention_dp_group if self.role == "attention" else self.replica_group
        return ProcessGroupCollection(
            tp=one, pp=one, mp=one, embd=one, pos_embd=one, cp=one, tp_cp=one, ep=one, expt_tp=one,
            tp_ep=one, tp_ep_pp=one, tp_dp_cp=dp, dp=dp, dp_cp=dp, intra_dp_cp=dp,
            expt_dp=self.replica_group, intra_expt_dp=self.replica_group, intra_dist_opt=dp,
            inter_dist_opt=one, hcp=None,
        )


def initialize_hetero_parallel(plan: HeteroPlan, timeout: datetime.timedelta | None = None,
                               device: torch.device | None = None,
                               wire_dtype: torch.dtype | None = None) -> HeteroParallelState:
    """Validate the plan against the job, then build every group (collective over the world).
    `timeout`: of every group (default: device.group_timeout of the world's backend, 10 minutes
    on NCCL). `device`: where this rank's tensors live (default: device.rank_device(), the
    current CUDA device when the world runs NCCL, else the CPU). `wire_dtype`: what tokens cross
    roles in (HeteroParallelState.wire_dtype)."""
    from megatron_hetermoe.parallel.device import check_rank_gpu, group_timeout, rank_device

    world, rank = dist.get_world_size(), dist.get_rank()
    from megatron_hetermoe.planner.profiles import known_gpu_types

    plan.validate(world_size=world, known_gpu_types=known_gpu_types())  # before any group exists
    if device is None:
        device = rank_device()
    check_rank_gpu(plan, rank, device)  # this torch runs on this GPU, of the plan's type
    timeout = timeout or group_timeout()

    def new(ranks):
        return dist.new_group(sorted(ranks), timeout=timeout)

    made: dict[str, dist.ProcessGroup] = {}
    for gi, g in enumerate(plan.groups):
        d, c, n = new(g.members), new(g.members), new(g.members)
        if rank in g.members:
            made["dispatch"], made["combine"], made["counts"] = d, c, n
    attn = new(plan.attention_ranks)
    n_members = len(plan.groups[0].members)
    for k in range(n_members):
        grp = new([g.members[k] for g in plan.groups])
        if any(g.members[k] == rank for g in plan.groups):
            made["replica"] = grp
    for r in range(world):
        grp = new([r])
        if r == rank:
            made["self"] = grp
    world_group = new(range(world))

    gi = plan.group_of(rank)
    role = plan.role(rank)
    return HeteroParallelState(
        plan=plan, rank=rank, role=role, group_index=gi,
        member_index=plan.groups[gi].members.index(rank),
        attention_dp_rank=plan.attention_ranks.index(rank) if role == "attention" else None,
        dispatch_group=made["dispatch"], combine_group=made["combine"], counts_group=made["counts"],
        attention_dp_group=attn if role == "attention" else None,
        replica_group=made["replica"], self_group=made["self"], world_group=world_group, device=device,
        wire_dtype=wire_dtype,
    )
