"""The "hetero" parallel dimension: process groups built from a plan.

Megatron's RankGenerator knows tp/cp/ep/dp/pp only, so HeterMoE builds its own groups and
hands modules an explicit ProcessGroupCollection. Every rank creates every group of two or more
ranks in the same order (torch's new_group is collective over the world). A group of one rank is
the rank's one-rank group, made once and shared by every kind that is the rank alone, without a
world-wide call per rank (`OneRankGroups`). A rank's role is read from the plan once, here;
everything downstream reads it from HeteroParallelState.

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
import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
import torch.distributed as dist

from megatron_hetermoe.parallel.layout import (
    COLLECTION_DIMS,
    GROUP_KINDS,
    ZP_COMMUNICATORS,
    RankLayout,
    group_kind,
    group_plan,
)
from megatron_hetermoe.plan.hetero_plan import RUNTIME_EXPERT_RECOMPUTE, HeteroPlan, PlanError, ZPGroup
from megatron_hetermoe.vocabulary import Role

if TYPE_CHECKING:
    from megatron_hetermoe.parallel.expert_load import ExpertLoadMeter


_T = TypeVar("_T")


class _FromLayout(Generic[_T]):
    """A read-only HeteroParallelState attribute that is its RankLayout's of the same name: the
    plan arithmetic is the layout's alone (parallel/layout.py), the state only hands it on."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: HeteroParallelState | None, owner: type | None = None) -> _T:
        return self if state is None else getattr(state.layout, self.name)

    def __set__(self, state: HeteroParallelState, value: object) -> None:
        raise AttributeError(f"HeteroParallelState.{self.name} is its layout's (RankLayout.{self.name}); "
                             f"build the state from another RankLayout to change it")


@dataclass
class HeteroParallelState:
    """A rank's plan arithmetic (`layout`: its coordinates on its pool's grid) and its process
    groups, one per group kind (parallel/layout.py): the ZP group's three communicators, the
    attention pool's groups along its axes (tp, cp, dp, pp), the replica group, the rank alone and
    the world."""
    layout: RankLayout
    # Every group kind (layout.GROUP_KINDS, and the ZP group's communicators "dispatch", "combine",
    # "counts") -> this rank's process group of that kind; None where it has none (an expert rank's
    # attention kinds). Read it with group(kind).
    groups: dict[str, dist.ProcessGroup | None]
    # Where every tensor this rank's plugin code allocates lives; worker threads read it
    # here, never from torch.cuda.current_device().
    device: torch.device = torch.device("cpu")
    # The dtype tokens cross roles in, the same on every rank (config.PoolPrecision.wire);
    # None: each rank's params_dtype, one precision on every rank.
    wire_dtype: torch.dtype | None = None
    # Counts the tokens this rank's experts receive (parallel/expert_load.py); None: not measured.
    load_meter: "ExpertLoadMeter | None" = None

    # ---- the plan arithmetic, read once (RankLayout) -----------------------------------------
    plan = _FromLayout[HeteroPlan]()
    rank = _FromLayout[int]()
    role = _FromLayout[Role]()
    group_index = _FromLayout[int]()
    member_index = _FromLayout[int]()
    attention_dp_rank = _FromLayout[int | None]()
    stage = _FromLayout[int]()  # the pipeline stage this rank computes (0 without pipeline stages)
    tp_rank = _FromLayout[int]()
    cp_rank = _FromLayout[int]()

    def owns_gradient(self, is_expert: bool) -> bool:
        return self.layout.owns_gradient(is_expert)

    @property
    def zp(self) -> ZPGroup:
        return self.plan.groups[self.group_index]

    @functools.cached_property
    def stage_members(self) -> list[int]:
        """The ranks of this rank's stage of its ZP group (the whole group at one stage): the
        members its dispatch, combine and counts communicators connect."""
        return self.plan.stage_members(self.group_index, self.stage)

    @property
    def num_members_per_group(self) -> int:
        """Attention members of the ZP group's stage: data-parallel copies of the stage's dense
        weights, each with its own microbatches (its attention ranks / member_size)."""
        return len(self.plan.stage_ranks(self.group_index, self.stage)[0]) // self.plan.member_size

    @property
    def comm_order(self) -> list[int]:
        """The ZP group's ranks in the order all-to-all split sizes refer to them: torch numbers
        a group's members by ascending global rank, whatever order the plan lists them in."""
        return sorted(self.stage_members)

    def layer_order(self, layer: int) -> list[int]:
        """Expert ids of `layer` in the order they travel: holder by holder in comm_order, ids
        ascending."""
        pl = self.zp.placement[layer]
        return [e for r in self.comm_order for e in pl.get(r, [])]

    def member_sizes(self, layer: int) -> list[int]:
        """How many experts of `layer` each member holds, in comm_order: the k-th member holds the
        next member_sizes[k] experts of layer_order."""
        pl = self.zp.placement[layer]
        return [len(pl.get(r, [])) for r in self.comm_order]

    def local_experts(self, layer: int) -> list[int]:
        return list(self.zp.placement[layer].get(self.rank, []))

    def received_counts(self, layer: int, all_counts: torch.Tensor) -> torch.Tensor:
        """[member, local expert] token counts this rank receives, from the counts exchange's
        [member, expert in layer_order] result (no columns when it holds no expert)."""
        order = self.layer_order(layer)
        return all_counts[:, [order.index(e) for e in self.local_experts(layer)]]

    @functools.cached_property
    def transport(self):
        """How this rank's ZP group moves tokens (parallel/extension.py Transport; the backends in
        parallel/transport.py): with no collective in a group of one rank, else all_to_all over its
        dispatch, combine and counts groups. The state is the transport's ZPGeometry."""
        from megatron_hetermoe.parallel.transport import (
            AllToAllTransport,
            LoopbackTransport,
        )

        if len(self.stage_members) == 1:
            return LoopbackTransport(self, str(dist.get_backend(self.group("dispatch"))))
        return AllToAllTransport(self, *(self.group(c) for c in ZP_COMMUNICATORS))

    # ---- the groups megatron-core modules get --------------------------------------------------
    def group(self, kind: str) -> dist.ProcessGroup | None:
        """This rank's process group of `kind` (parallel/layout.py GROUP_KINDS, or one of the ZP
        group's communicators; "zp": the dispatch communicator)."""
        if kind == "zp":
            kind = "dispatch"
        if kind not in self.groups:
            raise KeyError(f"group kind {kind!r} is unknown; one of {sorted(self.groups)} or 'zp'")
        return self.groups[kind]

    def megatron_group(self, dim: str) -> dist.ProcessGroup:
        """The group serving megatron-core dimension `dim` on this rank (layout.MEGATRON_DIMS)."""
        return self.group(self.layout.megatron_kind(dim))

    def pg_collection(self):
        """ProcessGroupCollection for megatron-core modules on this rank, from layout.MEGATRON_DIMS
        (the same table install_parallel_state sets megatron-core's globals from): tensor
        parallelism is an attention member's TP group, every other model-parallel dimension this
        rank alone; data parallelism is the attention DP group (attention ranks) or the expert
        replica group (expert ranks)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection(**{d: self.megatron_group(d) for d in COLLECTION_DIMS}, hcp=None)


class OneRankGroups(str, enum.Enum):
    """How a rank gets its one-rank group (megatron-core needs a ProcessGroup for a dimension of
    size 1; it serves every group kind that is the rank alone, `self` included)."""
    # The rank alone (new_group(use_local_synchronization=True)): gloo, and NCCL initialised lazily
    # (no device bound to the default group: Megatron-LM's initialize), where a one-rank
    # communicator is made without the other ranks.
    LOCAL = "local"
    # One split of the world's communicator gives every rank its own (split_group): NCCL with a
    # device bound to the default group (eager, parallel/device.init_distributed), where every
    # new_group is an ncclCommSplit the whole world must join, so a local one would hang.
    SPLIT = "split"
    # Every rank makes every rank's group, the world joining each (the only way left with an
    # eagerly initialised NCCL world on a torch without split_group): world-size splits.
    WORLD = "world"


def one_rank_groups(default_group: dist.ProcessGroup | None = None) -> OneRankGroups:
    """How this job makes one-rank groups (OneRankGroups), from its default process group
    (default: dist.group.WORLD)."""
    import torch.distributed.distributed_c10d as c10d

    default_group = dist.group.WORLD if default_group is None else default_group
    torchcomms = getattr(c10d, "_use_torchcomms_enabled", lambda: False)  # torch >= 2.12: split_group only
    if getattr(default_group, "bound_device_id", None) is None and not torchcomms():
        return OneRankGroups.LOCAL
    return OneRankGroups.SPLIT if hasattr(dist, "split_group") else OneRankGroups.WORLD


_ONE_RANK: dict[int, dist.ProcessGroup] = {}  # rank -> its one-rank group, while its world lives


def _one_rank_group(rank: int, world: int, timeout: datetime.timedelta, how: OneRankGroups) -> dist.ProcessGroup:
    """This rank's one-rank group; collective over the world only with SPLIT (once) and WORLD.
    Made once per process and world: torch names it by its ranks, so a second would clash."""
    g = _ONE_RANK.get(rank)
    if g is not None:
        try:
            if dist.get_process_group_ranks(g) == [rank]:
                return g
        except (KeyError, ValueError, RuntimeError):  # its world was destroyed since
            pass
    if how is OneRankGroups.LOCAL:
        g = dist.new_group([rank], timeout=timeout, use_local_synchronization=True)
    elif how is OneRankGroups.SPLIT:
        g = dist.split_group(split_ranks=[[r] for r in range(world)], timeout=timeout)
    else:
        for r in range(world):
            made = dist.new_group([r], timeout=timeout)
            if r == rank:
                g = made
    _ONE_RANK[rank] = g
    return g


def initialize_hetero_parallel(plan: HeteroPlan, timeout: datetime.timedelta | None = None,
                               device: torch.device | None = None,
                               wire_dtype: torch.dtype | None = None) -> HeteroParallelState:
    """Validate the plan against the job, then build every group of layout.group_plan: those of
    two or more ranks collective over the world, in its order; those of one rank are the rank's
    one-rank group (OneRankGroups). `timeout`: of every group (default: device.group_timeout of the world's
    backend, 10 minutes on NCCL). `device`: where this rank's tensors live (default:
    device.rank_device(), the current CUDA device when the world runs NCCL, else the CPU).
    `wire_dtype`: what tokens cross roles in (HeteroParallelState.wire_dtype)."""
    from megatron_hetermoe.parallel.device import (
        check_rank_gpu,
        group_timeout,
        rank_device,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    from megatron_hetermoe.planner.profiles import known_gpu_types

    plan.validate(world_size=world, known_gpu_types=known_gpu_types())  # before any group exists
    if plan.expert_recompute not in RUNTIME_EXPERT_RECOMPUTE:
        raise PlanError(f"plan expert_recompute={plan.expert_recompute!r} is priced by the planner but not run here "
                        f"(the attention ranks would resend every dispatched token with its gradient); remake the "
                        f"plan with `hetermoe plan --expert-recompute keep-inputs` (or off)")
    if device is None:
        device = rank_device()
    check_rank_gpu(plan, rank, device)  # this torch runs on this GPU, of the plan's type
    timeout = timeout or group_timeout()
    layout = RankLayout(plan, rank)
    one = _one_rank_group(rank, world, timeout, one_rank_groups())  # every rank, at this point
    made: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}  # (kind, ranks) -> this rank's group
    first: dict[tuple[int, ...], dist.ProcessGroup] = {}  # ranks -> the first group made of them
    for name, ranks in group_plan(plan):
        if len(ranks) == 1:  # the rank alone: no world-wide call
            continue
        g = dist.new_group(ranks, timeout=timeout)  # every rank creates every such group, in this order
        if rank in ranks:
            key = tuple(sorted(ranks))
            made[group_kind(name), key] = g
            first.setdefault(key, g)
    return HeteroParallelState(layout=layout, groups=rank_groups(layout, made, first, one), device=device,
                               wire_dtype=wire_dtype)


def rank_groups(layout: RankLayout, made: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup],
                first: dict[tuple[int, ...], dist.ProcessGroup], one: dist.ProcessGroup,
                ) -> dict[str, dist.ProcessGroup | None]:
    """Each group kind's process group on this rank, from its ranks on the grid: the rank alone is
    its one-rank group; a kind made under its own name (group_plan) is that group; a kind whose
    ranks equal another's where a dimension is 1 (tp_cp is tp at CP 1, tp_pp is pp at TP 1, the
    CP kinds made once per rank set) is the first group made of those ranks."""
    zp = tuple(layout.ranks("zp"))
    groups: dict[str, dist.ProcessGroup | None] = {c: one if len(zp) == 1 else made[c, zp] for c in ZP_COMMUNICATORS}
    for kind in GROUP_KINDS:
        if kind == "zp":
            continue
        ranks = layout.ranks(kind)
        if ranks is None or len(ranks) == 1:
            groups[kind] = None if ranks is None else one
            continue
        key = tuple(sorted(ranks))
        groups[kind] = made.get((kind, key)) or first[key]
    return groups
