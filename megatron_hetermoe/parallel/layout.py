"""Rank arithmetic of a HeterMoE plan: who a rank is and which groups it belongs to, with no
process group (what torchtitan's ParallelDims is for its mesh).

Two things live here, and the process groups (parallel/state.py) and megatron-core's globals
(parallel/megatron_globals.py) are both derived from them, so they cannot disagree:
- `RankLayout`: one rank's coordinates on its pool's grid (parallel/grid.py: the attention pool
  `tp x cp x dp x pp x zp`, the expert pool `ep x pp x zp`), hence its role, ZP group, stage,
  data-parallel rank, which gradients it counts in the global norm, and its group of each kind
  (`GROUP_KINDS`) as the ranks along that kind's axes (`ATTENTION_KIND_AXES`);
  `group_plan(plan)`: every group of the job, in the order every rank creates them.
- `MEGATRON_DIMS`: each megatron-core process-group dimension (ProcessGroupCollection's fields,
  and the parallel_state globals that have none) -> the group kind that serves it on a rank of
  each role. Model parallelism inside a role is `InnerLayout` (tp, cp, pp on attention ranks,
  etp on expert ranks): tensor parallelism on attention members (the plan's attention_tp), the
  rest 1, so every other model-parallel dimension is the rank alone; pipeline parallelism (the
  plan's pipeline_stages) on attention ranks: "pp" links member k of every stage of a ZP group
  (at one tensor-parallel position), "embd" its first and last stage, "tp_pp" the member's TP
  ranks of every stage (Megatron's model-parallel group).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from megatron_hetermoe.parallel.grid import UNIT_AXES, PoolGrid, plan_grids
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.vocabulary import Role

# Group kinds: "zp" (the members of a ZP group: the dispatch, combine and counts communicators),
# "tp" (an attention member's tensor-parallel ranks; the rank alone elsewhere or at attention_tp 1),
# "attention_dp" (the attention ranks at one tensor-parallel position, one per member: replicas of
# the same shard of the dense weights), "attention_tp_dp" (every attention rank: Megatron's
# tensor x data group; attention_dp at attention_tp 1), "replica" (the k-th member of every ZP
# group: replicas of what that member holds), "pp" (the attention ranks of one pipeline: member k of
# each stage of a ZP group, at one TP position; the rank alone elsewhere or at one stage), "embd" (a
# pipeline's first and last stage: the tied embedding; the rank alone on other stages), "tp_pp" (an
# attention member's TP ranks over its pipeline's stages: Megatron's model-parallel group), "self",
# "world". With pipeline stages, "zp", "attention_dp" and "attention_tp_dp" are one stage's.
# Context parallelism (the plan's attention_cp > 1) adds "cp" (the member's ranks at this TP position),
# "tp_cp" (the whole member), "attention_dp_cp" (the stage's attention ranks at this TP position: Megatron's
# dp x cp, over which dense gradients are summed) and "attention_tp_dp_at_cp" (those at this CP position:
# Megatron's tp x dp without cp); at attention_cp 1 they are "self", "tp", "attention_dp" and
# "attention_tp_dp". "attention_dp" is then the ranks at this (TP, CP) position of every member.
GROUP_KINDS = ("zp", "tp", "attention_dp", "attention_tp_dp", "replica", "pp", "embd", "tp_pp", "self", "world",
               "cp", "tp_cp", "attention_dp_cp", "attention_tp_dp_at_cp")
CP_KINDS = ("cp", "tp_cp", "attention_dp_cp", "attention_tp_dp_at_cp")  # made only at attention_cp > 1
ZP_COMMUNICATORS = ("dispatch", "combine", "counts")


@dataclass(frozen=True)
class InnerLayout:
    """Model parallelism inside a role's pool (issue: TP/PP inside the pools): tensor and context
    parallelism on attention members (the plan's attention_tp, with sequence parallelism, and
    attention_cp) and pipeline stages (the plan's pipeline_stages, each with its own attention and
    expert ranks); etp is 1 (not built yet)."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        if self.etp != 1:
            raise NotImplementedError(f"{self}: expert tensor parallelism inside a HeterMoE pool is not built yet")

    @classmethod
    def of(cls, plan: HeteroPlan) -> "InnerLayout":
        return cls(tp=plan.attention_tp, cp=plan.attention_cp, pp=plan.pipeline_stages)


# megatron-core dimension -> the group kind serving it, per role. "dp" is the role's data-parallel
# group: the attention ranks' DP group (dense weights) or the expert replica group (experts).
# Tensor-parallel dimensions are the member's TP group on an attention rank (an attention rank has
# no expert parallelism, so TP x EP is its TP group too; TP x PP and TP x EP x PP are its "tp_pp").
# Megatron's position-embedding group (the first stage alone) is the rank alone.
# Context parallelism: "cp" the member's CP ranks, "tp_cp" the whole member; the data-parallel dimensions
# that include CP (Megatron's dp_cp, over which dense gradients are reduced) its attention_dp_cp group.
_TENSOR_PARALLEL = ("tp", "tp_ep")
_TENSOR_PIPELINE = ("mp", "tp_ep_pp")
_MODEL_PARALLEL = ("pos_embd", "ep", "expt_tp", "inter_dist_opt", "inter_partial_expt_dp")
_DATA_PARALLEL_CP = ("dp_cp", "intra_dp_cp", "intra_dist_opt")
_EXPERT_DATA_PARALLEL = ("expt_dp", "intra_expt_dp")
MEGATRON_DIMS: dict[str, dict[Role, str]] = {
    **{d: {"attention": "tp", "expert": "self"} for d in _TENSOR_PARALLEL},
    "tp_cp": {"attention": "tp_cp", "expert": "self"},
    "cp": {"attention": "cp", "expert": "self"},
    **{d: {"attention": "tp_pp", "expert": "self"} for d in _TENSOR_PIPELINE},
    "pp": {"attention": "pp", "expert": "self"},
    "embd": {"attention": "embd", "expert": "self"},
    **{d: {"attention": "self", "expert": "self"} for d in _MODEL_PARALLEL},
    "dp": {"attention": "attention_dp", "expert": "replica"},
    **{d: {"attention": "attention_dp_cp", "expert": "replica"} for d in _DATA_PARALLEL_CP},
    "tp_dp_cp": {"attention": "attention_tp_dp", "expert": "replica"},
    "tp_dp": {"attention": "attention_tp_dp_at_cp", "expert": "replica"},
    **{d: {"attention": "replica", "expert": "replica"} for d in _EXPERT_DATA_PARALLEL},
}
# ProcessGroupCollection's fields this plugin fills (hcp, hierarchical context parallelism: none).
COLLECTION_DIMS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                   "tp_dp_cp", "dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp", "intra_dist_opt",
                   "inter_dist_opt")


# Each group kind of an attention rank as its axes of the attention grid (parallel/grid.py); an expert
# rank's "replica" is its expert grid's zp axis, its model-parallel kinds the rank alone, its
# attention kinds none. "zp" (both pools at one (pp, zp)), "embd", "self" and "world" are no axes.
ATTENTION_KIND_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "tp_cp": ("tp", "cp"), "pp": ("pp",), "tp_pp": ("tp", "pp"),
    "attention_dp": ("dp", "zp"), "attention_dp_cp": ("cp", "dp", "zp"),
    "attention_tp_dp": ("tp", "cp", "dp", "zp"), "attention_tp_dp_at_cp": ("tp", "dp", "zp"),
    "replica": ("zp",),
}


@dataclass(frozen=True)
class RankLayout:
    """One rank of a plan, by arithmetic alone: its coordinates on its pool's grid."""
    plan: HeteroPlan
    rank: int

    @property
    def inner(self) -> InnerLayout:
        return InnerLayout.of(self.plan)

    @functools.cached_property
    def grids(self) -> dict[Role, PoolGrid]:
        return plan_grids(self.plan)

    @functools.cached_property
    def role(self) -> Role:
        return self.plan.role(self.rank)

    @property
    def grid(self) -> PoolGrid:
        """This rank's pool."""
        return self.grids[self.role]

    @functools.cached_property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate on each axis of its pool's grid."""
        return self.grid.coords(self.rank)

    @property
    def group_index(self) -> int:
        return self.coords["zp"]

    @property
    def member_index(self) -> int:
        """Position in its ZP group's members (attention ranks first)."""
        return self.plan.groups[self.group_index].members.index(self.rank)

    @property
    def stage(self) -> int:
        """The pipeline stage this rank computes (0 without pipeline stages)."""
        return self.coords["pp"]

    @property
    def stage_position(self) -> int:
        """An attention rank's position among its stage's attention ranks (TP positions included)."""
        c, plan = self.coords, self.plan
        return c["tp"] + plan.attention_tp * (c["cp"] + plan.attention_cp * c["dp"])

    @property
    def tp_rank(self) -> int:
        """Position in its attention member's tensor-parallel group (0 on an expert rank)."""
        return self.coords.get("tp", 0)

    @property
    def cp_rank(self) -> int:
        """Position in its attention member's context-parallel group (0 on an expert rank): which
        two of the sequence's 2 x attention_cp chunks it holds."""
        return self.coords.get("cp", 0)

    @property
    def attention_dp_rank(self) -> int | None:
        """Data-parallel rank: which attention member, over all ZP groups, this rank is part of
        (every rank of a member reads the same data); None on an expert rank."""
        if self.role != Role.ATTENTION:
            return None
        return self.coords["zp"] * self.grid.size("dp") + self.coords["dp"]

    def owns_gradient(self, is_expert: bool) -> bool:
        """Whether this rank counts a gradient it holds in the world's gradient norm, so that each
        distinct parameter is counted exactly once: a dense parameter (replicated on every
        attention member and on a member's CP ranks) by the ranks of attention member 0 at CP
        position 0 (each its own tensor-parallel shard; Megatron's norm skips tensor-parallel
        duplicates on TP ranks > 0); an expert (replicated across ZP groups, on an expert rank or,
        with Asym-EA, an attention rank) by its holder in ZP group 0."""
        if is_expert:
            return self.group_index == 0
        return self.attention_dp_rank == 0 and self.cp_rank == 0

    def ranks(self, kind: str) -> list[int] | None:
        """The global ranks of this rank's group of `kind`, ascending as a process group numbers
        its members ("pp": stage 0 first), from its pool's grid (None: it has none, an expert
        rank's attention kinds)."""
        c, grid = self.coords, self.grid
        if kind == "zp":  # the dispatch unit: both pools' ranks at this rank's (pp, zp)
            unit = {a: c[a] for a in UNIT_AXES}
            return sorted(r for pool in self.grids.values() for r in pool.where(**unit))
        if kind == "self":
            return [self.rank]
        if kind == "world":
            return list(range(self.plan.world_size))
        if kind not in GROUP_KINDS:
            raise ValueError(f"group kind {kind!r} is unknown; one of {GROUP_KINDS}")
        if self.role != Role.ATTENTION:
            if kind == "replica":
                return sorted(grid.group(self.rank, ("zp",)))
            return None if kind.startswith("attention") else [self.rank]
        if kind == "embd":  # a pipeline's first and last stage; the rank alone on the others
            pipeline = grid.group(self.rank, ("pp",))
            return sorted({pipeline[0], pipeline[-1]}) if c["pp"] in (0, grid.size("pp") - 1) else [self.rank]
        group = grid.group(self.rank, ATTENTION_KIND_AXES[kind])
        return group if kind == "pp" else sorted(group)

    def megatron_kind(self, dim: str) -> str:
        """The group kind serving megatron-core dimension `dim` on this rank."""
        return MEGATRON_DIMS[dim][self.role]

    def moved_to(self, plan: HeteroPlan) -> "RankLayout":
        """This rank in `plan`, the plan a live expert move goes to: only where experts sit may differ,
        so the process groups made for this layout serve it. PlanError if either pool's grid differs
        (a rank changing role or position would keep groups of the old plan)."""
        new = RankLayout(plan, self.rank)
        for role, grid in self.grids.items():
            other = new.grids[role]
            if other != grid:
                raise PlanError(
                    f"a live move to a plan whose {role} pool differs: {dict(zip(grid.axes, grid.shape))} of "
                    f"ranks {list(grid.ranks)} before, {dict(zip(other.axes, other.shape))} of ranks "
                    f"{list(other.ranks)} after; a move may change where experts sit only (restart on the new "
                    f"plan to change roles or positions)")
        return new


def staged_name(name: str, stage: int, stages: int) -> str:
    """A per-stage group's name: the name itself without pipeline stages (as before them)."""
    return name if stages == 1 else f"{name}@{stage}"


def group_plan(plan: HeteroPlan) -> list[tuple[str, list[int]]]:
    """Every process group of the job as (name, ranks), in the order every rank creates those of
    two or more ranks (torch's new_group is collective over the world; a group of one rank is
    that rank's one-rank group, made without the world: parallel/state.py OneRankGroups): per ZP
    group (per stage of it, with pipeline stages) its dispatch, combine and counts communicators;
    the attention DP group (with attention_tp > 1: one TP group per attention member, one DP group
    per TP position, and all attention ranks; with pipeline stages, those of each stage); with
    pipeline stages, each pipeline's pp and embedding groups (and, with attention_tp > 1, its
    members' tp_pp groups); one replica group per member position; one group per rank; and the
    world. With attention_cp > 1, the CP_KINDS groups follow (cp_group_plan), each rank set once."""
    out: list[tuple[str, list[int]]] = []
    grids = plan_grids(plan)
    att, exp = grids[Role.ATTENTION], grids[Role.EXPERT]
    G, P, t, ms = len(plan.groups), plan.pipeline_stages, plan.attention_tp, plan.member_size
    for gi in range(G):  # one dispatch unit per stage (unit gi * P + stage)
        for s in range(P):
            unit = sorted(att.where(pp=s, zp=gi) + exp.where(pp=s, zp=gi))
            out += [(f"{c}[{gi * P + s}]", unit) for c in ZP_COMMUNICATORS]
    if t > 1:
        out += [(f"tp[{i * t}]", sorted(g)) for i, g in enumerate(att.groups(("tp",)))]
    dp_groups = att.groups(ATTENTION_KIND_AXES["attention_dp"])  # stage by stage, (TP, CP) positions fastest
    for s in range(P):  # one data-parallel group per (TP, CP) position of a stage, then the stage's
        dp = [g for g in dp_groups if att.coords(g[0])["pp"] == s]
        if ms == 1:  # "tp" is "self" and "attention_tp_dp" is "attention_dp": no more groups
            out.append((staged_name("attention_dp", s, P), sorted(dp[0])))
        else:
            out += [(staged_name(f"attention_dp[{j}]", s, P), sorted(g)) for j, g in enumerate(dp)]
            out.append((staged_name("attention_tp_dp", s, P), sorted(att.where(pp=s))))
    if P > 1:
        for gi in range(G):
            pipelines = [att.group(r, ("pp",)) for r in att.where(pp=0, zp=gi)]  # by position in a stage
            for pos, pipeline in enumerate(pipelines):
                out.append((f"pp[{gi}.{pos}]", pipeline))
                out.append((f"embd[{gi}.{pos}]", sorted({pipeline[0], pipeline[-1]})))
            if t > 1:
                for first in range(0, len(pipelines), t):
                    out.append((f"tp_pp[{gi}.{first}]", sorted(att.group(pipelines[first][0], ("tp", "pp")))))
    for k, r in enumerate(plan.groups[0].members):  # member k of every ZP group
        out.append((f"replica[{k}]", sorted(grids[plan.role(r)].group(r, ("zp",)))))
    out += [(f"self[{r}]", [r]) for r in range(plan.world_size)]
    out.append(("world", list(range(plan.world_size))))
    return out + cp_group_plan(plan, {tuple(r) for _, r in out})


def group_kind(name: str) -> str:
    """The kind of a group_plan group from its name ("attention_dp[1]@2" -> "attention_dp";
    a ZP group's communicators are "dispatch", "combine", "counts")."""
    return re.split(r"[\[@]", name, maxsplit=1)[0]


def cp_group_plan(plan: HeteroPlan, made: set[tuple[int, ...]]) -> list[tuple[str, list[int]]]:
    """The context-parallel groups (CP_KINDS) of every attention rank, each rank set not in `made`
    once, in rank order (none at attention_cp 1: the plans before context parallelism create the
    same groups in the same order)."""
    out: list[tuple[str, list[int]]] = []
    if plan.attention_cp == 1:
        return out
    for r in plan.attention_ranks:
        lay = RankLayout(plan, r)
        for kind in CP_KINDS:
            ranks = lay.ranks(kind)
            if len(ranks) > 1 and tuple(ranks) not in made:
                made.add(tuple(ranks))
                out.append((f"{kind}{ranks}", ranks))
    return out
