"""Rank arithmetic of a HeterMoE plan: who a rank is and which groups it belongs to, with no
process group (what torchtitan's ParallelDims is for its mesh).

Two things live here, and the process groups (parallel/state.py) and megatron-core's globals
(parallel/megatron_globals.py) are both derived from them, so they cannot disagree:
- `RankLayout`: one rank's role, ZP group, position, data-parallel rank, which gradients it
  counts in the global norm, and the groups it belongs to as rank lists (`GROUP_KINDS`);
  `group_plan(plan)`: every group of the job, in the order every rank creates them.
- `MEGATRON_DIMS`: each megatron-core process-group dimension (ProcessGroupCollection's fields,
  and the parallel_state globals that have none) -> the group kind that serves it on a rank of
  each role. Model parallelism inside a role is `InnerLayout` (tp, cp, pp on attention ranks,
  etp on expert ranks): 1 everywhere today, so every model-parallel dimension is the rank alone;
  tensor and pipeline parallelism inside the pools go here (a kind per dimension and role).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_hetermoe.config import Role
from megatron_hetermoe.plan.hetero_plan import HeteroPlan

# Group kinds: "zp" (the members of a ZP group: the dispatch, combine and counts communicators),
# "attention_dp" (every attention rank: replicas of the dense weights), "replica" (the k-th member
# of every ZP group: replicas of what that member holds), "self", "world".
GROUP_KINDS = ("zp", "attention_dp", "replica", "self", "world")
ZP_COMMUNICATORS = ("dispatch", "combine", "counts")


@dataclass(frozen=True)
class InnerLayout:
    """Model parallelism inside a role's pool (issue: TP/PP inside the pools). All 1 today."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        if (self.tp, self.cp, self.pp, self.etp) != (1, 1, 1, 1):
            raise NotImplementedError(f"{self}: model parallelism inside a HeterMoE pool is not built yet")


# megatron-core dimension -> the group kind serving it, per role. "dp" is the role's data-parallel
# group: the attention ranks' DP group (dense weights) or the expert replica group (experts).
_MODEL_PARALLEL = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                   "inter_dist_opt", "inter_partial_expt_dp")
_DATA_PARALLEL = ("tp_dp_cp", "tp_dp", "dp", "dp_cp", "intra_dp_cp", "intra_dist_opt")
_EXPERT_DATA_PARALLEL = ("expt_dp", "intra_expt_dp")
MEGATRON_DIMS: dict[str, dict[Role, str]] = {
    **{d: {"attention": "self", "expert": "self"} for d in _MODEL_PARALLEL},
    **{d: {"attention": "attention_dp", "expert": "replica"} for d in _DATA_PARALLEL},
    **{d: {"attention": "replica", "expert": "replica"} for d in _EXPERT_DATA_PARALLEL},
}
# ProcessGroupCollection's fields this plugin fills (hcp, hierarchical context parallelism: none).
COLLECTION_DIMS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
                   "tp_dp_cp", "dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp", "intra_dist_opt",
                   "inter_dist_opt")


@dataclass(frozen=True)
class RankLayout:
    """One rank of a plan, by arithmetic alone."""
    plan: HeteroPlan
    rank: int
    inner: InnerLayout = InnerLayout()

    @property
    def role(self) -> Role:
        return self.plan.role(self.rank)

    @property
    def group_index(self) -> int:
        return self.plan.group_of(self.rank)

    @property
    def member_index(self) -> int:
        """Position in its ZP group's members (attention ranks first)."""
        return self.plan.groups[self.group_index].members.index(self.rank)

    @property
    def attention_dp_rank(self) -> int | None:
        """Data-parallel rank among all attention ranks (None on an expert rank)."""
        return self.plan.attention_ranks.index(self.rank) if self.role == "attention" else None

    def owns_gradient(self, is_expert: bool) -> bool:
        """Whether this rank counts a gradient it holds in the world's gradient norm, so that each
        distinct parameter is counted exactly once: a dense parameter (replicated on every
        attention rank) by attention DP rank 0; an expert (replicated across ZP groups, on an
        expert rank or, with Asym-EA, an attention rank) by its holder in ZP group 0."""
        if is_expert:
            return self.group_index == 0
        return self.attention_dp_rank == 0

    def ranks(self, kind: str) -> list[int] | None:
        """The global ranks of this rank's group of `kind`, ascending as a process group numbers
        its members (None: it has none, an expert rank's attention_dp)."""
        plan = self.plan
        if kind == "zp":
            return sorted(plan.groups[self.group_index].members)
        if kind == "attention_dp":
            return sorted(plan.attention_ranks) if self.role == "attention" else None
        if kind == "replica":
            return sorted(g.members[self.member_index] for g in plan.groups)
        if kind == "self":
            return [self.rank]
        if kind == "world":
            return list(range(plan.world_size))
        raise ValueError(f"group kind {kind!r} is unknown; one of {GROUP_KINDS}")

    def megatron_kind(self, dim: str) -> str:
        """The group kind serving megatron-core dimension `dim` on this rank."""
        return MEGATRON_DIMS[dim][self.role]


def group_plan(plan: HeteroPlan) -> list[tuple[str, list[int]]]:
    """Every process group of the job as (name, ranks), in the order every rank creates them
    (torch's new_group is collective over the world): per ZP group its dispatch, combine and
    counts communicators, the attention DP group, one replica group per member position, one
    group per rank, and the world."""
    out: list[tuple[str, list[int]]] = []
    for gi, g in enumerate(plan.groups):
        out += [(f"{c}[{gi}]", sorted(g.members)) for c in ZP_COMMUNICATORS]
    out.append(("attention_dp", sorted(plan.attention_ranks)))
    for k in range(len(plan.groups[0].members)):
        out.append((f"replica[{k}]", sorted(g.members[k] for g in plan.groups)))
    out += [(f"self[{r}]", [r]) for r in range(plan.world_size)]
    out.append(("world", list(range(plan.world_size))))
    return out
