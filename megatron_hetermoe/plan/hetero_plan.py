"""The HeterMoE plan: who does what, as a dataclass and a versioned JSON file.

A plan is the single source of a rank's role. It names, for every rank, its GPU type; the ZP
groups, each with M attention ranks and N expert ranks; and for every MoE layer of every group
which rank holds which experts (`placement[layer] = {rank: [expert ids]}`). Layers are counted
in MoE layers (`num_layers`, the task lists' L); a model with dense layers (Megatron's
--moe-layer-freq) names them by model index in `dense_layers`: they run on attention ranks
alone, and MoE layer k is model layer `moe_layer_ids[k]`. Multi-token prediction (Megatron's
--mtp-num-layers) adds `mtp_layers` model layers after the decoder's (`decoder_layers`): MTP
layer k is model layer decoder_layers + k, an MoE layer with a placement like any other unless
`dense_layers` names it (Megatron gives MTP layers the decoder's last layer's kind). Experts may sit on
attention ranks too (asymmetric expert assignment). Every group holds the same experts in the
same positions, so expert e of layer l on the k-th member of group 0 is replicated by the k-th
member of every other group (these replicas form that expert's data-parallel group).

Tensor parallelism on attention ranks (`attention_tp`, Megatron's --tensor-model-parallel-size with
--sequence-parallel): a group's attention ranks are M members of `attention_tp` consecutive ranks
each, as listed; each member is one Megatron TP group holding one copy of the dense weights, and
each of its ranks routes and dispatches its own sequence slice. Experts stay whole (expert tensor
parallelism 1), on expert ranks or, with Asym-EA, on single ranks of a member: the member's other TP
ranks dispatch to that rank as to an expert rank.

Context parallelism on attention ranks (`attention_cp`, Megatron's --context-parallel-size): a
member is then attention_tp x attention_cp consecutive ranks, tensor-parallel position fastest
(Megatron's tp-cp order); the member's ranks at one TP position are its CP group. Each CP rank
holds its two of the sequence's 2 x attention_cp chunks (Megatron's load-balanced split), gathers
the other ranks' keys and values for attention, and routes its own tokens to the experts like any
other attention rank.

Pipeline parallelism inside the pools (`pipeline_stages` P, Megatron's
--pipeline-model-parallel-size): the decoder layers split evenly into P stages (Megatron's default
split); a group's attention ranks are P runs of equal length, stage by stage, and so are its
expert ranks. Stage s of a group is its own dispatch unit: its attention members compute stage
s's layers (activations cross stages between attention ranks with Megatron's P2P, member k of
stage s to member k of stage s+1) and its expert ranks hold those layers' experts, so every
expert of a layer of stage s sits on a rank of stage s.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.limits import (
    MAX_MICROBATCHES,
    MAX_PLACEMENT_ENTRIES,
    MAX_RANKS,
    MODEL_LIMITS,
)
from megatron_hetermoe.plan.tasks import SCHEDULES, ZEBRA_WAVE_ORDERS
from megatron_hetermoe.vocabulary import Role, ScheduleName

PLAN_VERSION = 1


class PlanError(UserError, ValueError):
    """A plan that cannot run; the message names the bad value and the fix."""

# What an expert holder keeps for backward, lightest saving first (HeteroPlan.expert_recompute).
EXPERT_RECOMPUTE = ("off", "keep-inputs", "resend-inputs")
RUNTIME_EXPERT_RECOMPUTE = ("off", "keep-inputs")  # the levels the runtime runs

@dataclass
class ZPGroup:
    attention_ranks: list[int]
    expert_ranks: list[int]
    # placement[layer] maps a rank of this group to the sorted expert ids it holds in that layer.
    placement: list[dict[int, list[int]]]

    @property
    def members(self) -> list[int]:
        """Attention ranks first, then expert ranks: the order that lines groups up."""
        return list(self.attention_ranks) + list(self.expert_ranks)

    def owner(self, layer: int) -> dict[int, int]:
        """expert id -> rank holding it, for one layer."""
        return {e: r for r, es in self.placement[layer].items() for e in es}


@dataclass
class HeteroPlan:
    num_layers: int
    num_experts: int
    gpu_types: list[str]  # gpu_types[rank]
    groups: list[ZPGroup]
    num_microbatches: int = 1  # R: microbatches per step on each attention rank
    schedule: str = "distep"
    version: int = PLAN_VERSION
    meta: dict = field(default_factory=dict)  # free-form: model name, planner predictions
    dense_layers: list[int] = field(default_factory=list)  # model indices of the layers without experts
    mtp_layers: int = 0  # Megatron's --mtp-num-layers: the last model layers are MTP layers
    # What an expert holder keeps for backward (EXPERT_RECOMPUTE; the planner prices each level):
    # "off" its experts' intermediates; "keep-inputs" their inputs only, re-running the experts'
    # forward in backward. "resend-inputs" is priced, not run (RUNTIME_EXPERT_RECOMPUTE).
    expert_recompute: str = "off"
    # Tensor-parallel size of each attention member (module docstring); 1: one rank per member.
    attention_tp: int = 1
    # Context-parallel size of each attention member (module docstring); 1: no context parallelism.
    attention_cp: int = 1
    # Pipeline stages of each ZP group (module docstring); 1: no pipeline parallelism.
    pipeline_stages: int = 1
    # Zebra inside pipeline stages: Theorem 1 over this many groups of R / zebra_waves microbatches,
    # so a stage passes a group's outputs on while it computes the next (plan.tasks.zebra_tasks).
    zebra_waves: int = 1
    # The order of those groups on each stage: "gpipe", every group's forward before the first
    # backward (every stage keeps all R microbatches alive); "1f1b", Megatron's 1F1B over the
    # groups (stage i of P keeps at most min(W, P - i) groups alive). ZEBRA_WAVE_ORDERS.
    zebra_wave_order: str = "gpipe"
    # Megatron's virtual pipeline stages (--num-virtual-stages-per-pipeline-rank): each pipeline
    # stage holds this many model chunks, chunk v of stage s being Megatron's virtual stage v*P + s
    # (decoder_layers / (P * V) layers each); under DistEP the attention ranks run Megatron's
    # interleaved 1F1B, under zebra its order over waves of microbatches (plan.tasks
    # zebra_chunk_tasks); the stage's expert ranks mirror it over the experts of all its chunks.
    virtual_stages: int = 1
    # Megatron's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the
    # decoder layers of the first / last pipeline stage, the rest split evenly over the stages
    # between (None: Megatron's even split). Without virtual stages.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    # ---- layers: MoE layer k (placement, tasks) is model layer moe_layer_ids[k] --------------
    @property
    def model_layers(self) -> int:
        """The model's layer count: MoE layers and dense layers, the MTP layers included."""
        return self.num_layers + len(self.dense_layers)

    @property
    def decoder_layers(self) -> int:
        """Megatron's --num-layers: the model layers before the MTP layers."""
        return self.model_layers - self.mtp_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        dense = set(self.dense_layers)
        return [i for i in range(self.model_layers) if i not in dense]

    def moe_index(self, model_layer: int) -> int | None:
        """The MoE layer index of model layer `model_layer` (None: a dense layer)."""
        if model_layer in self.dense_layers:
            return None
        return model_layer - sum(1 for d in self.dense_layers if d < model_layer)

    # ---- derived views -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.gpu_types)

    @property
    def attention_ranks(self) -> list[int]:
        return [r for g in self.groups for r in g.attention_ranks]

    @property
    def expert_ranks(self) -> list[int]:
        return [r for g in self.groups for r in g.expert_ranks]

    @property
    def member_size(self) -> int:
        """Ranks of one attention member of one stage: attention_tp x attention_cp."""
        return self.attention_tp * self.attention_cp

    def attention_members(self, group: int) -> list[list[int]]:
        """The attention members of ZP group `group`: its attention ranks in runs of member_size
        (each one copy of its stage's dense weights reading one stream of microbatches), stage by
        stage."""
        a, t = self.groups[group].attention_ranks, self.member_size
        return [list(a[i:i + t]) for i in range(0, len(a), t)]

    @property
    def num_attention_members(self) -> int:
        """Data-parallel size of the dense weights: attention members of one pipeline stage over
        all ZP groups (each reads its own microbatches; the stages of a pipeline read the same)."""
        return len(self.attention_ranks) // (self.member_size * self.pipeline_stages)

    # ---- pipeline stages (pipeline_stages; one stage: the whole group) -----------------------
    def stage_ranks(self, group: int, stage: int) -> tuple[list[int], list[int]]:
        """(attention ranks, expert ranks) of stage `stage` of ZP group `group`."""
        g, P = self.groups[group], self.pipeline_stages
        a, x = len(g.attention_ranks) // P, len(g.expert_ranks) // P
        return (list(g.attention_ranks[stage * a:(stage + 1) * a]), list(g.expert_ranks[stage * x:(stage + 1) * x]))

    def stage_members(self, group: int, stage: int) -> list[int]:
        """The ranks of one stage of a ZP group, attention ranks first: its dispatch unit."""
        a, x = self.stage_ranks(group, stage)
        return a + x

    def stage_attention_ranks(self, stage: int) -> list[int]:
        """The attention ranks of pipeline stage `stage` over every ZP group."""
        return [r for gi in range(len(self.groups)) for r in self.stage_ranks(gi, stage)[0]]

    def attention_pipelines(self, group: int) -> list[list[int]]:
        """ZP group `group`'s pipelines: for each position among a stage's attention ranks (TP
        positions included), the rank at that position in every stage, stage 0 first."""
        stages = [self.stage_ranks(group, s)[0] for s in range(self.pipeline_stages)]
        return [[st[pos] for st in stages] for pos in range(len(stages[0]))]

    def stage_of(self, rank: int) -> int:
        """The pipeline stage `rank` computes (0 without pipeline parallelism)."""
        g = self.groups[self.group_of(rank)]
        ranks = g.attention_ranks if rank in g.attention_ranks else g.expert_ranks
        return ranks.index(rank) // (len(ranks) // self.pipeline_stages)

    def stage_layer_counts(self) -> list[int]:
        """Decoder layers of each pipeline stage: Megatron's even split, or its uneven one (the
        first and last stages' counts given, the rest even over the stages between)."""
        P, n = self.pipeline_stages, self.decoder_layers
        F, La = self.first_stage_layers, self.last_stage_layers
        if F is None and La is None:
            return [n // P] * P
        middle = P - (F is not None) - (La is not None)
        rest = n - (F or 0) - (La or 0)
        each = rest // middle if middle > 0 else 0
        return [F if F is not None else each] + [each] * (P - 2) + [La if La is not None else each]

    def stage_model_layers(self, stage: int) -> list[int]:
        """The model layers of pipeline stage `stage`, ascending: Megatron's even split of the
        decoder layers, over all of the stage's virtual stages; the MTP layers go with the last
        stage (chunk_model_layers)."""
        return [i for v in range(self.virtual_stages) for i in self.chunk_model_layers(stage, v)]

    @property
    def chunk_layers(self) -> int:
        """Model layers in each virtual stage (each pipeline stage's, without virtual stages)."""
        return self.decoder_layers // (self.pipeline_stages * self.virtual_stages)

    def chunk_model_layers(self, stage: int, chunk: int) -> list[int]:
        """The model layers of model chunk `chunk` of pipeline stage `stage`: Megatron's virtual
        stage chunk * P + stage of the even split (the stage's layers without virtual stages); the
        last virtual stage also holds the MTP layers, as megatron-core builds its MTP block there
        (mtp_on_this_rank without a pipeline layout)."""
        last = stage == self.pipeline_stages - 1 and chunk == self.virtual_stages - 1
        mtp = list(range(self.decoder_layers, self.model_layers)) if last else []
        if self.virtual_stages == 1:
            counts = self.stage_layer_counts()
            first = sum(counts[:stage])
            return list(range(first, first + counts[stage])) + mtp
        n = self.chunk_layers
        first = (chunk * self.pipeline_stages + stage) * n
        return list(range(first, first + n)) + mtp

    def chunk_moe_layers(self, stage: int, chunk: int) -> list[int]:
        """The MoE layer indices of model chunk `chunk` of pipeline stage `stage`, ascending (without
        virtual stages: the stage's, the MTP layers' included at one stage)."""
        if self.virtual_stages == 1:
            return self.stage_moe_layers(stage)
        ids = [self.moe_index(i) for i in self.chunk_model_layers(stage, chunk)]
        return [k for k in ids if k is not None]

    def stage_moe_layers(self, stage: int) -> list[int]:
        """The MoE layer indices (placement, tasks) of pipeline stage `stage`, ascending."""
        if self.pipeline_stages == 1:
            return list(range(self.num_layers))
        ids = [self.moe_index(i) for i in self.stage_model_layers(stage)]
        return [k for k in ids if k is not None]

    def place_evenly(self, groups: Iterable[int]) -> None:
        """Set the placement of ZP groups `groups`: each MoE layer's experts split evenly
        (split_evenly) over the expert ranks of its pipeline stage (all of them at one stage)."""
        E = list(range(self.num_experts))
        stage = [self.stage_of_layer(l) for l in range(self.num_layers)]
        for gi in groups:
            per_stage = [split_evenly(E, self.stage_ranks(gi, s)[1]) for s in range(self.pipeline_stages)]
            self.groups[gi].placement = [dict(per_stage[stage[l]]) for l in range(self.num_layers)]

    def stage_of_layer(self, layer: int) -> int:
        """The pipeline stage of MoE layer `layer` (an MTP layer's: the last)."""
        if self.pipeline_stages == 1:
            return 0
        model = self.moe_layer_ids[layer]
        if model >= self.decoder_layers:
            return self.pipeline_stages - 1
        if self.virtual_stages == 1:
            return next(s for s in range(self.pipeline_stages) if model in self.stage_model_layers(s))
        return model // self.chunk_layers % self.pipeline_stages

    def role(self, rank: int) -> Role:
        for g in self.groups:
            if rank in g.attention_ranks:
                return Role.ATTENTION
            if rank in g.expert_ranks:
                return Role.EXPERT
        raise PlanError(f"rank {rank} is in no ZP group of the plan (world size {self.world_size})")

    def group_of(self, rank: int) -> int:
        for i, g in enumerate(self.groups):
            if rank in g.members:
                return i
        raise PlanError(f"rank {rank} is in no ZP group of the plan (world size {self.world_size})")

    def local_experts(self, rank: int, layer: int) -> list[int]:
        """Expert ids of `layer` held by `rank` (empty for an attention rank without offload)."""
        return list(self.groups[self.group_of(rank)].placement[layer].get(rank, []))

    def local_experts_at(self, rank: int, model_layer: int) -> list[int]:
        """Expert ids `rank` holds in model layer `model_layer` (a name's layer index)."""
        layer = self.moe_index(model_layer)
        if layer is None:
            raise PlanError(f"model layer {model_layer} has experts here but is a dense layer of the plan "
                            f"(dense_layers={self.dense_layers}); remake the plan for this model")
        return self.local_experts(rank, layer)

    def experts_on_attention_ranks(self) -> int:
        """How many (layer, expert) pairs per group are offloaded to attention ranks."""
        return sum(self.experts_on_attention_per_layer())

    def experts_on_attention_ranks_any(self) -> bool:
        """Whether any group places an expert on an attention rank (safe before validation)."""
        return any(pl.get(r) for g in self.groups for pl in g.placement for r in g.attention_ranks)

    def experts_on_attention_per_layer(self) -> list[int]:
        """Per layer, how many experts of a group sit on its attention ranks (Asym-EA)."""
        g = self.groups[0]
        return [sum(len(g.placement[l].get(r, [])) for r in g.attention_ranks) for l in range(self.num_layers)]

    # ---- validation --------------------------------------------------------------------
    def validate(self, world_size: int | None = None, known_gpu_types: Iterable[str] | None = None) -> None:
        """Raise PlanError naming the bad value and the fix. Touches no process group."""
        if type(self.version) is not int or self.version != PLAN_VERSION:  # "1" is not 1, nor is true
            what = (f"{self.version!r} (a {type(self.version).__name__})" if type(self.version) is not int
                    else str(self.version))
            raise PlanError(f"plan version {what} is not supported; this build reads version {PLAN_VERSION}, the "
                            f'integer ("version": {PLAN_VERSION})')
        if self.schedule not in SCHEDULES:
            raise PlanError(f"plan schedule {self.schedule!r} is unknown; use one of {list(SCHEDULES)}")
        for name in ("num_layers", "num_experts", "num_microbatches"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:  # bool is an int subclass: `true` must not mean 1
                raise PlanError(f"plan {name}={v!r} must be a positive integer")
        check_plan_size(self.num_layers, self.num_experts, len(self.groups), len(self.gpu_types),
                        self.num_microbatches)
        dense = self.dense_layers
        if not isinstance(dense, list) or any(type(d) is not int for d in dense):
            raise PlanError(f"plan dense_layers={dense!r} must be a list of model layer indices")
        bad = sorted({d for d in dense if not 0 <= d < self.model_layers} | {d for d in dense if dense.count(d) > 1})
        if bad:
            raise PlanError(f"plan dense_layers {bad}: each must be a distinct model layer index in "
                            f"0..{self.model_layers - 1} (num_layers={self.num_layers} MoE layers + {len(dense)} "
                            f"dense layers)")
        if type(self.mtp_layers) is not int or not 0 <= self.mtp_layers < self.model_layers:
            raise PlanError(f"plan mtp_layers={self.mtp_layers!r} must be an integer from 0 (no multi-token "
                            f"prediction) to {self.model_layers - 1} (the model has {self.model_layers} layers)")
        if not isinstance(self.meta, dict):
            raise PlanError(f"plan meta={self.meta!r} must be a JSON object (free-form notes) or absent")
        if self.expert_recompute not in EXPERT_RECOMPUTE:
            raise PlanError(f"plan expert_recompute={self.expert_recompute!r} is unknown; use one of "
                            f"{list(EXPERT_RECOMPUTE)}")
        if not self.groups:
            raise PlanError("plan has no ZP groups; add at least one group with attention and expert ranks")
        if type(self.attention_tp) is not int or self.attention_tp < 1:
            raise PlanError(f"plan attention_tp={self.attention_tp!r} must be a positive integer (the attention "
                            f"members' --tensor-model-parallel-size; 1 without tensor parallelism)")
        if type(self.attention_cp) is not int or self.attention_cp < 1:
            raise PlanError(f"plan attention_cp={self.attention_cp!r} must be a positive integer (the attention "
                            f"members' --context-parallel-size; 1 without context parallelism)")
        if self.member_size > 1:
            for gi, g in enumerate(self.groups):
                if len(g.attention_ranks) % self.member_size:
                    raise PlanError(f"ZP group {gi} has {len(g.attention_ranks)} attention ranks, not a multiple of "
                                    f"attention_tp x attention_cp = {self.attention_tp} x {self.attention_cp}; give "
                                    f"each group M x {self.member_size} attention ranks")
        self._validate_stages()
        if world_size is not None and world_size != self.world_size:
            raise PlanError(
                f"plan is for {self.world_size} ranks (len(gpu_types)) but the job has world size "
                f"{world_size}; launch {self.world_size} processes or make a plan for {world_size}"
            )
        if known_gpu_types is not None:
            # Case-insensitive ("a40" = "A40"); "cpu" is always known: CPU ranks run unemulated.
            known = {k.lower() for k in known_gpu_types} | {"cpu"}
            for r, t in enumerate(self.gpu_types):
                if not isinstance(t, str) or t.lower() not in known:
                    raise PlanError(
                        f"rank {r} has unknown GPU type {t!r}; known types: {sorted(known)} "
                        f"(add a profile to configs/gpus/ for a new type)"
                    )
        seen: dict[int, str] = {}
        for gi, g in enumerate(self.groups):
            if not g.attention_ranks:
                raise PlanError(f"ZP group {gi} has no attention ranks; give it at least one")
            for role, ranks in (("attention", g.attention_ranks), ("expert", g.expert_ranks)):
                for r in ranks:
                    if type(r) is not int or not 0 <= r < self.world_size:
                        raise PlanError(
                            f"ZP group {gi} names {role} rank {r!r}, outside 0..{self.world_size - 1} "
                            f"(world size = len(gpu_types) = {self.world_size})"
                        )
                    where = f"{role} rank of ZP group {gi}"
                    if r in seen:
                        raise PlanError(f"rank {r} is both {seen[r]} and {where}; each rank has exactly one role")
                    seen[r] = where
        missing = sorted(set(range(self.world_size)) - set(seen))
        if missing:
            raise PlanError(
                f"plan has {self.world_size} ranks but ranks {missing} are in no ZP group; "
                f"assign them a role or shrink gpu_types"
            )
        shape = (len(self.groups[0].attention_ranks), len(self.groups[0].expert_ranks))
        for gi, g in enumerate(self.groups):
            if (len(g.attention_ranks), len(g.expert_ranks)) != shape:
                raise PlanError(
                    f"ZP group {gi} is {len(g.attention_ranks)}:{len(g.expert_ranks)} but group 0 is "
                    f"{shape[0]}:{shape[1]}; all ZP groups must have the same M:N shape"
                )
            if len(g.placement) != self.num_layers:
                raise PlanError(
                    f"ZP group {gi} places experts for {len(g.placement)} layers but the plan has "
                    f"num_layers={self.num_layers}; give one placement per MoE layer"
                )
            members = set(g.members)
            for l, pl in enumerate(g.placement):
                count: dict[int, int] = {}
                for r, es in pl.items():
                    if r not in members:
                        raise PlanError(
                            f"layer {l} of ZP group {gi} places experts {es} on rank {r}, which is not "
                            f"a member of that group {sorted(members)}"
                        )
                    for e in es:
                        if type(e) is not int or not 0 <= e < self.num_experts:
                            raise PlanError(
                                f"layer {l} of ZP group {gi}: expert id {e!r} on rank {r} is outside "
                                f"0..{self.num_experts - 1}"
                            )
                        count[e] = count.get(e, 0) + 1
                twice = sorted(e for e, c in count.items() if c > 1)
                if twice:
                    raise PlanError(
                        f"layer {l} of ZP group {gi}: expert(s) {twice} placed more than once; "
                        f"place each expert on exactly one rank"
                    )
                never = sorted(set(range(self.num_experts)) - set(count))
                if never:
                    raise PlanError(
                        f"layer {l} of ZP group {gi}: expert(s) {never} placed on no rank; "
                        f"place each expert on exactly one rank"
                    )
            if gi:
                ref = self.groups[0]
                for l in range(self.num_layers):
                    for k, (r0, r) in enumerate(zip(ref.members, g.members)):
                        a = sorted(ref.placement[l].get(r0, []))
                        b = sorted(g.placement[l].get(r, []))
                        if a != b:
                            raise PlanError(
                                f"layer {l}: member {k} of ZP group {gi} (rank {r}) holds experts {b} "
                                f"but member {k} of group 0 (rank {r0}) holds {a}; every group must "
                                f"place experts alike so replicas line up"
                            )
        if self.attention_cp > 1:
            self._validate_context_parallel()

    def _validate_context_parallel(self) -> None:
        """PlanError for what has not run with attention_cp > 1: multi-token prediction (Megatron
        rolls its tokens across the CP ranks' chunks). Experts on attention ranks (Asym-EA) run: they
        receive every CP rank's tokens like an expert rank's experts, and Megatron's DDP scales their
        gradients by its dp x cp group, as the expert ranks' share does (training/assembly.py)."""
        if self.mtp_layers:
            raise PlanError(f"plan attention_cp={self.attention_cp} with mtp_layers={self.mtp_layers}: multi-token "
                            f"prediction with context parallelism is not built yet; use attention_cp 1")

    def _validate_stages(self) -> None:
        """PlanError unless the pipeline stages divide the layers and every group's ranks, and
        each layer's experts sit on its own stage's ranks."""
        P = self.pipeline_stages
        if type(P) is not int or P < 1:
            raise PlanError(f"plan pipeline_stages={P!r} must be a positive integer (Megatron's "
                            f"--pipeline-model-parallel-size; 1 without pipeline parallelism)")
        W = self.zebra_waves
        if type(W) is not int or W < 1 or self.num_microbatches % W:
            raise PlanError(f"plan zebra_waves={W!r} must be a positive divisor of num_microbatches="
                            f"{self.num_microbatches}; 1 runs Theorem 1 over all of them")
        if W > 1 and (P == 1 or self.schedule != ScheduleName.ZEBRA):
            raise PlanError(f"plan zebra_waves={W} needs schedule 'zebra' and pipeline stages (it has schedule "
                            f"{self.schedule!r}, pipeline_stages={P}): waves let a stage pass outputs on early, which "
                            f"one stage, or DistEP, has no use for; set zebra_waves to 1")
        if self.zebra_wave_order not in ZEBRA_WAVE_ORDERS:
            raise PlanError(f"plan zebra_wave_order={self.zebra_wave_order!r} is not one of {ZEBRA_WAVE_ORDERS}")
        if self.zebra_wave_order != "gpipe" and W == 1:
            raise PlanError(f"plan zebra_wave_order={self.zebra_wave_order!r} orders zebra_waves > 1 groups of "
                            f"microbatches, and this plan has one; set zebra_waves, or zebra_wave_order 'gpipe'")
        V = self.virtual_stages
        if type(V) is not int or V < 1:
            raise PlanError(f"plan virtual_stages={V!r} must be a positive integer (Megatron's "
                            f"--num-virtual-stages-per-pipeline-rank; 1 without virtual pipeline stages)")
        if V > 1 and P == 1:
            raise PlanError(f"plan virtual_stages={V} needs pipeline stages (it has pipeline_stages={P}): virtual "
                            f"stages interleave model chunks over the pipeline stages; set virtual_stages to 1")
        uneven = {k: v for k, v in (("first_stage_layers", self.first_stage_layers),
                                    ("last_stage_layers", self.last_stage_layers)) if v is not None}
        for k, v in uneven.items():
            if type(v) is not int or v < 1:
                raise PlanError(f"plan {k}={v!r} must be a positive integer (Megatron's "
                                f"--decoder-{k.split('_')[0]}-pipeline-num-layers) or absent (the even split)")
        if uneven and (P == 1 or V > 1):
            raise PlanError(f"plan {', '.join(f'{k}={v}' for k, v in uneven.items())} needs pipeline stages and no "
                            f"virtual stages (it has pipeline_stages={P}, virtual_stages={V}): uneven splits with "
                            f"virtual stages are not built; drop them or the virtual stages")
        if P == 1:
            return
        if uneven:
            middle = P - len(uneven)
            rest = self.decoder_layers - sum(uneven.values())
            if rest < 0 or (middle > 0 and (rest % middle or rest == 0)) or (middle == 0 and rest != 0):
                raise PlanError(f"plan {', '.join(f'{k}={v}' for k, v in uneven.items())}: the other "
                                f"{self.decoder_layers - sum(uneven.values())} of {self.decoder_layers} decoder layers "
                                f"do not split evenly over the {middle} stage(s) between (Megatron's rule); give "
                                f"counts whose remainder the middle stages divide")
        elif self.decoder_layers % P:
            raise PlanError(f"plan pipeline_stages={P} does not divide the {self.decoder_layers} decoder layers "
                            f"(Megatron's even split); use a divisor of {self.decoder_layers}, or uneven first/last "
                            f"stage layers (first_stage_layers, last_stage_layers)")
        if V > 1 and self.decoder_layers % (P * V):
            raise PlanError(f"plan pipeline_stages x virtual_stages = {P} x {V} does not divide the "
                            f"{self.decoder_layers} decoder layers (Megatron's even split into virtual stages); use "
                            f"virtual_stages dividing {self.decoder_layers // P}")
        empty = [s for s in range(P) if not self.stage_moe_layers(s)]
        if empty:
            raise PlanError(f"pipeline stage(s) {empty} of {P} hold no MoE layer (dense_layers={self.dense_layers}); "
                            f"their expert ranks would idle: use fewer stages")
        dense_chunks = [(s, v) for s in range(P) for v in range(V) if V > 1 and not self.chunk_moe_layers(s, v)]
        if dense_chunks and self.schedule == ScheduleName.ZEBRA:
            raise PlanError(f"model chunk(s) (pipeline stage, chunk) {dense_chunks} hold no MoE layer "
                            f"(dense_layers={self.dense_layers}) and zebra cuts a chunk's stages at its MoE layers; "
                            f"use fewer virtual stages, or schedule 'distep'")
        per = P * self.member_size
        for gi, g in enumerate(self.groups):
            if len(g.attention_ranks) % per:
                raise PlanError(f"ZP group {gi} has {len(g.attention_ranks)} attention ranks, not a multiple of "
                                f"pipeline_stages x attention_tp x attention_cp = {P} x {self.attention_tp} x "
                                f"{self.attention_cp}; give each stage the same attention members")
            if len(g.expert_ranks) % P or not g.expert_ranks:
                raise PlanError(f"ZP group {gi} has {len(g.expert_ranks)} expert ranks, not a positive multiple of "
                                f"pipeline_stages={P}; give each stage the same number of expert ranks")
            for pipeline in self.attention_pipelines(gi):
                if pipeline != sorted(pipeline):
                    raise PlanError(f"ZP group {gi}: the pipeline of attention ranks {pipeline} (stage 0 to {P - 1}) "
                                    f"does not ascend; a pipeline's ranks must ascend with its stages "
                                    f"(Megatron numbers pipeline stages by rank): list each stage's ranks after the "
                                    f"previous stage's")
            for l, pl in enumerate(g.placement):
                if l >= self.num_layers:
                    break
                s = self.stage_of_layer(l)
                members = set(self.stage_members(gi, s))
                off = sorted(r for r, es in pl.items() if es and r not in members)
                if off:
                    raise PlanError(f"layer {l} of ZP group {gi} is in pipeline stage {s} but places experts on "
                                    f"rank(s) {off}, outside that stage's ranks {sorted(members)}; place a stage's "
                                    f"experts on its own ranks")

    # ---- (de)serialization -------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        for g in d["groups"]:
            g["placement"] = [{str(r): sorted(es) for r, es in sorted(pl.items())} for pl in g["placement"]]
        if not d["dense_layers"]:  # every layer an MoE layer: the file reads as before dense layers existed
            del d["dense_layers"]
        else:
            d["dense_layers"] = sorted(d["dense_layers"])
        if not d["mtp_layers"]:  # likewise without multi-token prediction
            del d["mtp_layers"]
        if d["expert_recompute"] == "off":  # and with experts keeping their intermediates
            del d["expert_recompute"]
        if d["attention_tp"] == 1:  # and without tensor parallelism
            del d["attention_tp"]
        if d["attention_cp"] == 1:  # and without context parallelism
            del d["attention_cp"]
        if d["pipeline_stages"] == 1:  # and without pipeline parallelism
            del d["pipeline_stages"]
        if d["zebra_waves"] == 1:  # and with Theorem 1 over all microbatches
            del d["zebra_waves"]
        if d["zebra_wave_order"] == "gpipe":  # and with every group's forward first
            del d["zebra_wave_order"]
        if d["virtual_stages"] == 1:  # and without virtual pipeline stages
            del d["virtual_stages"]
        for k in ("first_stage_layers", "last_stage_layers"):  # and with Megatron's even split
            if d[k] is None:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HeteroPlan":
        if not isinstance(d, dict):
            raise PlanError(f"a plan is a JSON object, got {type(d).__name__}")
        known = {"num_layers", "num_experts", "gpu_types", "groups", "num_microbatches", "schedule", "version", "meta",
                 "dense_layers", "mtp_layers", "expert_recompute", "attention_tp", "attention_cp", "pipeline_stages",
                 "zebra_waves", "zebra_wave_order", "virtual_stages", "first_stage_layers", "last_stage_layers"}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"plan has unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        for k in ("num_layers", "num_experts", "gpu_types", "groups"):
            if k not in d:
                raise PlanError(f"plan is missing the field {k!r}")
        if not isinstance(d["gpu_types"], list) or not all(isinstance(t, str) for t in d["gpu_types"]):
            raise PlanError(f"plan gpu_types={d['gpu_types']!r} must be a list of GPU type names, one per rank")
        if not isinstance(d["groups"], list):
            raise PlanError(f"plan groups={d['groups']!r} must be a list of ZP groups")
        groups = []
        for gi, g in enumerate(d["groups"]):
            try:
                if not all(isinstance(g[k], list) for k in ("attention_ranks", "expert_ranks", "placement")):
                    raise TypeError("attention_ranks, expert_ranks and placement must be lists")
                # Strict ids: int("2") for JSON's string keys only; 2.7 or true is not an expert id.
                placement = [{_rank_key(r): sorted(_strict_int(e) for e in es) for r, es in pl.items()}
                             for pl in g["placement"]]
                groups.append(ZPGroup(list(g["attention_ranks"]), list(g["expert_ranks"]), placement))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise PlanError(
                    f"ZP group {gi} is malformed ({type(e).__name__}: {e}); it needs attention_ranks, "
                    f"expert_ranks and placement (a list of {{rank: [experts]}})"
                ) from None
        rest = {k: d[k] for k in ("num_microbatches", "schedule", "version", "meta", "dense_layers", "mtp_layers",
                                  "expert_recompute", "attention_tp", "attention_cp", "pipeline_stages", "zebra_waves",
                                  "zebra_wave_order", "virtual_stages", "first_stage_layers",
                                  "last_stage_layers") if k in d}
        return cls(num_layers=d["num_layers"], num_experts=d["num_experts"], gpu_types=list(d["gpu_types"]),
                   groups=groups, **rest)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "HeteroPlan":
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)


def _strict_int(v) -> int:
    if type(v) is not int:
        raise ValueError(f"{v!r} is not an integer id")
    return v


def _rank_key(k) -> int:
    """A placement key: an int, or its decimal string (JSON object keys are strings)."""
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k)
    return _strict_int(k)


def split_evenly(items: list[int], holders: list[int]) -> dict[int, list[int]]:
    """Contiguous, as-even-as-possible split: 8 experts over 3 ranks -> 3/3/2."""
    n, k = len(items), len(holders)
    out, start = {}, 0
    for i, h in enumerate(holders):
        size = n // k + (1 if i < n % k else 0)
        out[h] = items[start:start + size]
        start += size
    return out


def check_plan_size(num_layers: int, num_experts: int, groups: int, world_size: int, num_microbatches: int) -> None:
    """PlanError when a plan asks for more than any cluster could hold (limits.py)."""
    for what, v, most in (("num_layers", num_layers, MODEL_LIMITS["num_layers"]),
                          ("num_experts", num_experts, MODEL_LIMITS["num_experts"]),
                          ("world size (ranks: ZP groups x (M + N))", world_size, MAX_RANKS),
                          ("num_microbatches", num_microbatches, MAX_MICROBATCHES)):
        if isinstance(v, int) and v > most:
            raise PlanError(f"plan {what}={v} is above {most}, the most any cluster could hold "
                            f"(megatron_hetermoe/limits.py); check the value")
    entries = groups * num_layers * num_experts
    if entries > MAX_PLACEMENT_ENTRIES:
        raise PlanError(f"plan of {groups} ZP groups x {num_layers} layers x {num_experts} experts places {entries} "
                        f"experts, above {MAX_PLACEMENT_ENTRIES} (megatron_hetermoe/limits.py); use fewer groups")


def even_plan(
    num_layers: int,
    num_experts: int,
    attention_ranks: int,
    expert_ranks: int,
    groups: int = 1,
    gpu_types: list[str] | None = None,
    attention_gpu: str = "cpu",
    expert_gpu: str = "cpu",
    num_microbatches: int = 1,
    schedule: str = "distep",
    dense_layers: list[int] | None = None,
    mtp_layers: int = 0,
    attention_tp: int = 1,
    pipeline_stages: int = 1,
    zebra_waves: int = 1,
    zebra_wave_order: str = "gpipe",
    virtual_stages: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    attention_cp: int = 1,
) -> HeteroPlan:
    """G groups of M attention + N expert ranks laid out group by group; experts split evenly
    over each group's expert ranks in every MoE layer (`num_layers` of them; `dense_layers`: the
    model's layers without experts, by model index; `mtp_layers`: how many of the last model
    layers are multi-token prediction layers; `attention_tp`, `attention_cp`: the M attention ranks
    are M / (attention_tp x attention_cp) members, tensor- and context-parallel). With
    `pipeline_stages` P > 1, M and N are per stage:
    a group is P stages of M attention + N expert ranks, laid out stage by stage, and a layer's
    experts split over its stage's N expert ranks; `zebra_waves`, `zebra_wave_order`,
    `virtual_stages`, `first_stage_layers`, `last_stage_layers`: the plan's."""
    M, N, P = attention_ranks, expert_ranks, pipeline_stages
    if any(type(v) is not int for v in (M, N, groups, P)) or M < 1 or N < 1 or groups < 1 or P < 1:
        raise PlanError(f"even plan needs integers M>=1, N>=1, groups>=1, pipeline_stages>=1; got M={M!r}, N={N!r}, "
                        f"groups={groups!r}, pipeline_stages={P!r}")
    check_plan_size(num_layers, num_experts, groups, groups * P * (M + N), num_microbatches)  # before allocating
    if N > num_experts:
        raise PlanError(f"{N} expert ranks for {num_experts} experts leaves ranks idle; use at most {num_experts}")
    zp = []
    for g in range(groups):  # group by group, stage by stage: M attention ranks, then N expert ranks
        bases = [(g * P + st) * (M + N) for st in range(P)]
        zp.append(ZPGroup([r for b in bases for r in range(b, b + M)],
                          [r for b in bases for r in range(b + M, b + M + N)], []))
    if gpu_types is None:
        gpu_types = ([attention_gpu] * M + [expert_gpu] * N) * (groups * P)
    plan = HeteroPlan(num_layers, num_experts, gpu_types, zp, num_microbatches, schedule,
                      dense_layers=list(dense_layers or []), mtp_layers=mtp_layers, attention_tp=attention_tp,
                      attention_cp=attention_cp, pipeline_stages=P, zebra_waves=zebra_waves,
                      zebra_wave_order=zebra_wave_order,
                      virtual_stages=virtual_stages, first_stage_layers=first_stage_layers,
                      last_stage_layers=last_stage_layers)
    plan._validate_stages()  # the layer split, before placing by it
    plan.place_evenly(range(groups))
    plan.validate()
    return plan
