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
  etp on expert ranks): tensor parallelism on attention members (the plan's attention_tp), the
  rest 1, so every other model-parallel dimension is the rank alone; pipeline parallelism (the
  plan's pipeline_stages) on attention ranks: "pp" links member k of every stage of a ZP group
  (at one tensor-parallel position), "embd" its first and last stage, "tp_pp" the member's TP
  ranks of every stage (Megatron's model-parallel group).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
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


@dataclass(frozen=True)
class RankLayout:
    """One rank of a plan, by arithmetic alone."""
    plan: HeteroPlan
    rank: int

    @property
    def inner(self) -> InnerLayout:
        return InnerLayout.of(self.plan)

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
    def stage(self) -> int:
        """The pipeline stage this rank computes (0 without pipeline stages)."""
        return self.plan.stage_of(self.rank)

    @property
    def stage_position(self) -> int:
        """An attention rank's position among its stage's attention ranks (TP positions included)."""
        g = self.plan.groups[self.group_index]
        per = len(g.attention_ranks) // self.plan.pipeline_stages
        return g.attention_ranks.index(self.rank) % per

    @property
    def tp_rank(self) -> int:
        """Position in its attention member's tensor-parallel group (0 on an expert rank)."""
        if self.role != Role.ATTENTION:
            return 0
        return self.plan.attention_ranks.index(self.rank) % self.plan.attention_tp

    @property
    def cp_rank(self) -> int:
        """Position in its attention member's context-parallel group (0 on an expert rank): which
        two of the sequence's 2 x attention_cp chunks it holds."""
        if self.role != Role.ATTENTION:
            return 0
        plan = self.plan
        return plan.attention_ranks.index(self.rank) % plan.member_size // plan.attention_tp

    @property
    def attention_dp_rank(self) -> int | None:
        """Data-parallel rank: which attention member, over all ZP groups, this rank is part of
        (every rank of a member reads the same data); None on an expert rank."""
        if self.role != Role.ATTENTION:
            return None
        plan = self.plan
        members = len(plan.groups[self.group_index].attention_ranks) // (plan.member_size * plan.pipeline_stages)
        return self.group_index * members + self.stage_position // plan.member_size

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
        its members (None: it has none, an expert rank's attention_dp)."""
        plan = self.plan
        t, ms = plan.attention_tp, plan.member_size
        attention = plan.attention_ranks
        if kind in ("attention_dp", "attention_tp_dp", "attention_dp_cp", "attention_tp_dp_at_cp"):
            attention = plan.stage_attention_ranks(self.stage)  # one stage's attention ranks over the groups
        if kind in CP_KINDS and self.role != Role.ATTENTION:
            return None if kind.startswith("attention") else [self.rank]
        if kind in ("cp", "tp_cp"):
            i = attention.index(self.rank)
            member = attention[i - i % ms:i - i % ms + ms]
            return sorted(member[self.tp_rank::t] if kind == "cp" else member)
        if kind == "attention_dp_cp":
            return sorted(attention[self.tp_rank::t])
        if kind == "attention_tp_dp_at_cp":
            return sorted(r for i, r in enumerate(attention) if i % ms // t == self.cp_rank)
        if kind == "zp":
            return sorted(plan.stage_members(self.group_index, self.stage))
        if kind == "tp":
            if self.role != Role.ATTENTION:
                return [self.rank]
            i = attention.index(self.rank) // t
            return sorted(attention[i * t:(i + 1) * t])
        if kind == "attention_dp":  # this rank's (TP, CP) position in every member
            if self.role != Role.ATTENTION:
                return None
            return sorted(attention[self.tp_rank + self.cp_rank * t::ms])
        if kind == "attention_tp_dp":
            return sorted(attention) if self.role == Role.ATTENTION else None
        if kind == "replica":
            return sorted(g.members[self.member_index] for g in plan.groups)
        if kind in ("pp", "embd", "tp_pp"):
            if self.role != Role.ATTENTION:
                return [self.rank]
            pipelines = plan.attention_pipelines(self.group_index)
            pos = self.stage_position
            pipeline = pipelines[pos]
            if kind == "pp":
                return pipeline
            if kind == "embd":
                ends = (0, plan.pipeline_stages - 1)
                return sorted({pipeline[0], pipeline[-1]}) if self.stage in ends else [self.rank]
            first = pos - pos % t
            return sorted(r for p in pipelines[first:first + t] for r in p)
        if kind == "self":
            return [self.rank]
        if kind == "world":
            return list(range(plan.world_size))
        raise ValueError(f"group kind {kind!r} is unknown; one of {GROUP_KINDS}")

    def megatron_kind(self, dim: str) -> str:
        """The group kind serving megatron-core dimension `dim` on this rank."""
        return MEGATRON_DIMS[dim][self.role]


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
    P = plan.pipeline_stages
    for gi in range(len(plan.groups)):  # one dispatch unit per stage (unit gi * P + stage)
        out += [(f"{c}[{gi * P + s}]", sorted(plan.stage_members(gi, s))) for s in range(P) for c in ZP_COMMUNICATORS]
    t, attention = plan.attention_tp, plan.attention_ranks
    if t > 1:
        out += [(f"tp[{i}]", sorted(attention[i:i + t])) for i in range(0, len(attention), t)]
    for s in range(P):
        stage, ms = plan.stage_attention_ranks(s), plan.member_size
        if ms == 1:  # "tp" is "self" and "attention_tp_dp" is "attention_dp": no more groups
            out.append((staged_name("attention_dp", s, P), sorted(stage)))
        else:
            out += [(staged_name(f"attention_dp[{j}]", s, P), sorted(stage[j::ms])) for j in range(ms)]
            out.append((staged_name("attention_tp_dp", s, P), sorted(stage)))
    if P > 1:
        for gi in range(len(plan.groups)):
            pipelines = plan.attention_pipelines(gi)
            for pos, pipeline in enumerate(pipelines):
                out.append((f"pp[{gi}.{pos}]", pipeline))
                out.append((f"embd[{gi}.{pos}]", sorted({pipeline[0], pipeline[-1]})))
            if t > 1:
                for first in range(0, len(pipelines), t):
                    out.append((f"tp_pp[{gi}.{first}]", sorted(r for p in pipelines[first:first + t] for r in p)))
    for k in range(len(plan.groups[0].members)):
        out.append((f"replica[{k}]", sorted(g.members[k] for g in plan.groups)))
    out += [(f"self[{r}]", [r]) for r in range(plan.world_size)]
    out.append(("world", list(range(plan.world_size))))
    return out + cp_group_plan(plan, {tuple(r) for _, r in out})


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
