"""HeterMoE with pipeline stages (plan.pipeline_stages P > 1): the step model of DistEP inside the
stages and the memory rule the planner prices such a plan with.

What runs (plan/hetero_plan.py, schedules/distep.py): each ZP group is P stages, each stage its
own M attention + N expert ranks; Megatron's even split of the decoder layers over the stages; a
layer's experts live on its stage's ranks. Under DistEP attention ranks run Megatron's
non-interleaved 1F1B over the stages (activations cross stages by P2P between attention ranks:
rank k of stage i to rank k of stage i+1), and each stage's expert ranks mirror 1F1B for that
stage's layers; that has no task lists, so it is priced here. Zebra inside the stages runs task
lists, which the event simulator prices (simulator.build_problem, with this module's pieces,
p2p_time and post_step), and emulated runs time (emulation/). Virtual stages are not built.

Step model (the 1F1B model of planner/HETERO_PP.md, with a DistEP stage):
  * T_i, one microbatch's forward + backward on stage i: DistEP does not overlap attention and
    experts, so it is the chain of the cost model's pieces, as the event simulator times them
    (simulator.build_problem): per attention piece (a zebra attention stage, cost.stage_time, with
    the dense layers the pipeline stage runs) and per MoE layer of the stage: dispatch D_F, the
    slowest stage member's experts (E_F; experts an attention rank holds, X_F, run at the same
    time), combine C_F; backward: the backward pieces, C_B, E_B/X_B, D_B. Collectives are the
    simulator's bipartite all-to-alls over the stage's members (rank1_collective_time); on
    stage i < P-1 also the P2P of the microbatch's activations to stage i+1 and of their
    gradient back (each attention rank its tokens; the slowest pair; not overlapped).
    With P = 1, R x T_0 is the event simulator's DistEP makespan (tests/planner check it).
    Why the pieces and not the simulator on a one-stage sub-plan: a sub-model's stage 0 would
    price the embedding and its last stage the output layer on every pipeline stage; the pieces
    put each where Megatron's split puts it.
  * step = sum_i T_i + (R - 1) max_i T_i (fill and drain once, then the slowest stage per
    microbatch; one_f_one_b_step), + post-step: per rank, all-reduce of its dense gradients over
    the attention ranks of its stage at its TP position in every ZP group, of its experts' over
    their replicas in the other groups, then its optimizer step; stages run theirs at once, the
    slowest rank counts.
Memory per rank of stage i (pipeline_memory): 1F1B keeps min(P - i, R) microbatches alive there
(Megatron's warm-up forwards + 1); zebra in W waves R / W x min(W, P - i) in 1F1B's order over
the waves, all R in GPipe's. Attention rank: CostModel.pipeline_attention_rank_bytes (the
stage's weights and state, embedding on stage 0, output layer and fp32 logits on the last stage,
one checkpointed input per attention piece per live microbatch, one working set). Expert rank:
its experts' weights and state and what each keeps for backward of the routed tokens of the live
microbatches at the expert-recompute level (CostModel.per_expert_bytes), one working set.

Attention pieces of a pipeline stage (stage_pieces): its MoE layers' zebra stages (and the head
stage L on the last), each with the stage's dense layers that come before it; dense layers after
the stage's last MoE layer (whose next MoE layer is on the next stage) run with that last piece.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, split_evenly
from megatron_hetermoe.plan.tasks import wave_warmup
from megatron_hetermoe.planner.cluster import (
    Cluster,
    Links,
    allreduce_time,
    rank1_collective_time,
    transfer_time,
)
from megatron_hetermoe.planner.cost_model import CostModel
from megatron_hetermoe.vocabulary import Role, ScheduleName, TaskKind

PIPELINE_STAGES = (1, 2, 4, 8)  # the pipeline sizes the search tries


def one_f_one_b_step(stage_times: list[float], microbatches: int) -> float:
    """Seconds of Megatron's non-interleaved 1F1B over stages taking stage_times[i] per microbatch
    (forward + backward): sum_i T_i + (R - 1) max_i T_i, without the post-step."""
    if microbatches < 1 or not stage_times:
        raise ValueError(f"1F1B needs R >= 1 microbatches and at least one stage; got R={microbatches}, "
                         f"{len(stage_times)} stage(s)")
    return sum(stage_times) + (microbatches - 1) * max(stage_times)


def live_microbatches(P: int, stage: int, R: int) -> int:
    """Microbatches whose activations stage `stage` of P holds at once under 1F1B: min(P - stage, R)."""
    return min(P - stage, R)


def stage_pieces(moe_ids: list[int], model_layers: int, P: int,
                 total_layers: int | None = None) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """(MoE layers, attention pieces) of each of P pipeline stages, for a model whose MoE layer k
    is model layer moe_ids[k] among `model_layers` decoder layers, split evenly (Megatron's
    default); the layers after them up to `total_layers` (MTP layers) are the last stage's. A
    piece is (zebra attention stage s, dense layers it runs); module docstring."""
    L = len(moe_ids)
    total = model_layers if total_layers is None else total_layers
    if P < 1 or model_layers % P:
        raise PlanError(f"pipeline_stages={P} does not divide the {model_layers} decoder layers (Megatron's even "
                        f"split); use a divisor of {model_layers}")
    per = model_layers // P
    moe_set = set(moe_ids)
    layers: list[list[int]] = [[] for _ in range(P)]
    for k, i in enumerate(moe_ids):
        layers[min(i // per, P - 1)].append(k)
    empty = [i for i in range(P) if not layers[i]]
    if empty:
        raise PlanError(f"pipeline stage(s) {empty} of {P} hold no MoE layer; their expert ranks would idle: use fewer "
                        f"stages")
    pieces: list[list[tuple[int, int]]] = []
    for i in range(P):
        own = layers[i] + ([L] if i == P - 1 else [])
        dense = {s: 0 for s in own}
        for d in range(i * per, (i + 1) * per if i < P - 1 else total):
            if d in moe_set:
                continue
            s = sum(1 for x in moe_ids if x < d)  # the zebra stage that runs it with one stage
            dense[s if s in dense else own[-1]] += 1
        pieces.append([(s, dense[s]) for s in own])
    return layers, pieces


def model_pieces(model: ModelConfig, P: int) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """stage_pieces of a model config (its decoder layers split evenly, its MTP layers the last stage's)."""
    return stage_pieces(model.planned_moe_layer_ids, model.num_layers, P,
                        model.num_layers + (model.mtp_num_layers or 0))


@dataclass
class PipelineLayout:
    """Who runs what, per ZP group and stage; all groups alike (as a plan's)."""

    P: int
    G: int
    R: int
    tp: int
    gpu_types: list[str]  # per rank of the cluster
    attention: list[list[list[int]]]  # [group][stage]: the stage's attention ranks
    experts: list[list[list[int]]]  # [group][stage]: the stage's expert ranks
    layers: list[list[int]]  # [stage]: its MoE layers
    pieces: list[list[tuple[int, int]]]  # [stage]: its attention pieces
    held: list[list[tuple[int, ...]]]  # [stage][j]: experts of its j-th MoE layer on each stage member (group 0)
    totals: list[tuple[int, ...]] | None = None  # [stage]: experts of all its layers on each member (group 0)
    member_gpus: list[tuple[str, ...]] | None = None  # [stage]: GPU type of each member (group 0)
    # With virtual stages (zebra's task lists only): [virtual stage u = chunk * P + stage]: its
    # attention pieces; `layers` and `pieces` then hold each stage's chunks' in chunk order.
    chunk_pieces: list[list[tuple[int, int]]] | None = None
    cp: int = 1  # the attention members' context-parallel size (a member is tp x cp ranks, TP fastest)

    def __post_init__(self) -> None:
        if self.totals is None:
            self.totals = [tuple(sum(col) for col in zip(*h)) for h in self.held]
        if self.member_gpus is None:
            self.member_gpus = [tuple(map(self.gpu_types.__getitem__, self.members(0, i))) for i in range(self.P)]

    def members(self, group: int, stage: int) -> list[int]:
        return self.attention[group][stage] + self.experts[group][stage]


def layout_of_plan(plan: HeteroPlan, validate: bool = True, virtual: bool = False) -> PipelineLayout:
    """The layout of a plan, any pipeline_stages (validated first unless `validate` is False: the
    search's skeleton plans place group 0 only, which is all the layout reads). `virtual`: a plan
    with virtual stages gets its chunks' pieces (chunk_pieces: Megatron's even split into P * V
    virtual stages, chunk c of stage i being virtual stage c * P + i), which zebra's task lists
    price; the 1F1B model does not price virtual stages (the split is refused as not P's)."""
    if validate:
        plan.validate()
    P, G, V = plan.pipeline_stages, len(plan.groups), plan.virtual_stages
    moe_ids = plan.moe_layer_ids
    chunk_pieces = None
    if virtual and V > 1:
        vlayers, chunk_pieces = stage_pieces(moe_ids, plan.decoder_layers, P * V, plan.model_layers)
        layers = [[k for c in range(V) for k in vlayers[c * P + i]] for i in range(P)]
        pieces = [[x for c in range(V) for x in chunk_pieces[c * P + i]] for i in range(P)]
    else:
        layers, pieces = stage_pieces(moe_ids, plan.decoder_layers, P, plan.model_layers)
    for i in range(P):  # the plan's own split must be ours
        if layers[i] != plan.stage_moe_layers(i):
            raise PlanError(f"pipeline stage {i}: the plan's MoE layers {plan.stage_moe_layers(i)} are not Megatron's "
                            f"even split {layers[i]}")
    att = [[plan.stage_ranks(g, i)[0] for i in range(P)] for g in range(G)]
    exp = [[plan.stage_ranks(g, i)[1] for i in range(P)] for g in range(G)]
    g0 = plan.groups[0]
    held = [[tuple(len(g0.placement[l].get(r, [])) for r in att[0][i] + exp[0][i]) for l in layers[i]]
            for i in range(P)]
    return PipelineLayout(P, G, plan.num_microbatches, plan.attention_tp, list(plan.gpu_types), att, exp, layers,
                          pieces, held, chunk_pieces=chunk_pieces, cp=plan.attention_cp)


def even_layout(model: ModelConfig, gpu_types: list[str], attn: list[int], expert: list[int], G: int, P: int,
                R: int, tp: int = 1, cp: int = 1) -> PipelineLayout:
    """The layout build_plan(..., pipeline_stages=P) makes without Asym-EA, without building the
    plan: group g's attention ranks attn[g*P*M:(g+1)*P*M], stage by stage M each (likewise the
    experts), each layer's experts split evenly over its stage's N expert ranks; attention members
    of tp x cp ranks."""
    if len(attn) % (G * P) or len(expert) % (G * P):
        raise PlanError(f"{len(attn)} attention and {len(expert)} expert ranks do not split into {G} groups of {P} "
                        f"stages")
    M, N = len(attn) // (G * P), len(expert) // (G * P)
    layers, pieces = model_pieces(model, P)
    att = [[attn[(g * P + i) * M:(g * P + i + 1) * M] for i in range(P)] for g in range(G)]
    exp = [[expert[(g * P + i) * N:(g * P + i + 1) * N] for i in range(P)] for g in range(G)]
    E = model.num_experts
    per = (0,) * M + tuple(len(v) for v in split_evenly(list(range(E)), list(range(N))).values())
    held = [[per] * len(layers[i]) for i in range(P)]
    totals = [tuple(c * len(layers[i]) for c in per) for i in range(P)]  # every layer of a stage alike
    gpus = [tuple(map(gpu_types.__getitem__, att[0][i] + exp[0][i])) for i in range(P)]
    return PipelineLayout(P, G, R, tp, gpu_types, att, exp, layers, pieces, held, totals, gpus, cp=cp)


def tokens(lay: PipelineLayout, cost: CostModel, global_batch: int) -> tuple[float, float]:
    """(tokens per attention rank per microbatch, routed tokens per expert per microbatch)."""
    M = len(lay.attention[0][0])
    t = float(global_batch) * cost.settings.seq_len / (lay.G * M * lay.R)
    return t, M * t * cost.model.moe_router_topk / cost.model.num_experts


@dataclass
class PipelineResult:
    """simulate_plan's result for a plan with pipeline stages: simulator.SimResult's fields (no task
    lists: problem and trace are None), and detail: per-stage times, bubble, post-step."""

    step_time_s: float
    tokens_per_s: float
    makespan_s: float  # the pipeline alone, before grad sync and optimizer
    utilization: dict[str, float]  # GPU type -> mean fraction of the step its ranks compute
    problem: None = None
    trace: None = None
    detail: dict = field(default_factory=dict)


def p2p_time(lay: PipelineLayout, cost: CostModel, cluster: Cluster, i: int, t: float,
             backward: bool = False) -> float:
    """One microbatch's activations from stage i to i+1 (backward: their gradient from i+1 back
    to i): every attention rank sends its t tokens to its counterpart at once; the slowest pair
    of any group counts. With virtual stages the last stage's next is the first."""
    nbytes = t * cost.token_bytes()
    nodes, nics = cluster.node_of(), cluster.nic_gbs()
    seen: dict[tuple, float] = {}
    worst = 0.0
    for g in range(lay.G):
        for src, dst in zip(lay.attention[g][i], lay.attention[g][(i + 1) % lay.P]):
            if backward:
                src, dst = dst, src
            # pairs alike in GPU types, node sharing and NICs take the same time
            key = (lay.gpu_types[src], lay.gpu_types[dst], nodes[src] == nodes[dst], nics[src], nics[dst])
            if key not in seen:
                seen[key] = transfer_time(cluster, cost.profiles, src, dst, nbytes)
            worst = max(worst, seen[key])
    return worst


def _p2p(lay: PipelineLayout, cost: CostModel, cluster: Cluster, i: int, t: float) -> float:
    """Activations of one microbatch from stage i to i+1 and their gradient back, one after the
    other (1F1B does not overlap them with the stage's work)."""
    return p2p_time(lay, cost, cluster, i, t) + p2p_time(lay, cost, cluster, i, t, backward=True)


def layer_collectives(cost: CostModel, cluster: Cluster, members: list[int], n_attention: int,
                      held: list[tuple[int, ...]], t: float) -> list[dict]:
    """Seconds of each layer's D_F, C_F, C_B and D_B for one microbatch of t tokens per attention
    rank: bipartite all-to-alls over `members` (its first `n_attention` the attention ranks),
    layer k's experts held[k][j] on member j (layers placed alike cost alike). With expert
    recompute 'resend-inputs' C_B carries the routed tokens again (twice D_F's bytes)."""
    E, tb = cost.model.num_experts, cost.model.moe_router_topk * cost.token_bytes()
    resend = cost.settings.expert_recompute == "resend-inputs"
    links = Links.for_ranks(cluster, members, cost.profiles)
    s_tok = [t] * n_attention + [0.0] * (len(members) - n_attention)
    seen: dict[tuple, dict] = {}
    for h in held:
        if h not in seen:
            w = [c / E for c in h]
            d_f = rank1_collective_time(links, s_tok, w, tb)  # D_F (and C_B)
            c_f = rank1_collective_time(links, w, s_tok, tb)  # C_F (and D_B: transposed)
            c_b = rank1_collective_time(links, s_tok, w, 2 * tb) if resend else d_f
            seen[h] = {TaskKind.D_F: d_f, TaskKind.C_F: c_f, TaskKind.C_B: c_b, TaskKind.D_B: c_f}
    return [seen[h] for h in held]


def stage_collectives(lay: PipelineLayout, cost: CostModel, cluster: Cluster, t: float) -> list[list[dict]]:
    """[stage][its k-th MoE layer]: layer_collectives over each stage's members (group 0)."""
    return [layer_collectives(cost, cluster, lay.members(0, i), len(lay.attention[0][i]), lay.held[i], t)
            for i in range(lay.P)]


def stage_times(lay: PipelineLayout, cost: CostModel, cluster: Cluster, global_batch: int) -> list[dict]:
    """Per stage: forward and backward of one microbatch (the DistEP chain), the P2P to the next
    stage, T (their sum), and each stage member's (group 0) compute seconds per microbatch."""
    t, tpe = tokens(lay, cost, global_batch)
    colls = stage_collectives(lay, cost, cluster, t)
    out = []
    for i in range(lay.P):
        att, exp = lay.attention[0][i], lay.experts[0][i]
        members = att + exp
        types = [lay.gpu_types[r] for r in members]
        a_types = sorted(set(types[:len(att)]))
        attn = {b: {g: sum(cost.stage_time(g, s, t, b, lay.tp, dense=d, cp=lay.cp) for s, d in lay.pieces[i])
                    for g in a_types} for b in (False, True)}
        busy = [attn[False][types[j]] + attn[True][types[j]] if j < len(att) else 0.0 for j in range(len(members))]
        seen: dict[tuple, tuple] = {}  # layers placed alike cost alike
        fwd = max(attn[False].values())
        bwd = max(attn[True].values())
        for held, c in zip(lay.held[i], colls[i]):
            if held not in seen:
                x = [[n * cost.expert_time(g, tpe, b) if n else 0.0 for n, g in zip(held, types)]
                     for b in (False, True)]
                seen[held] = (c[TaskKind.D_F] + max(x[0]) + c[TaskKind.C_F],
                              c[TaskKind.C_B] + max(x[1]) + c[TaskKind.D_B],
                              [a + b for a, b in zip(*x)], [0])
            f, b, x_busy, uses = seen[held]
            fwd += f
            bwd += b
            uses[0] += 1
        for _, _, x_busy, uses in seen.values():
            busy = [u + uses[0] * x for u, x in zip(busy, x_busy)]
        p2p = _p2p(lay, cost, cluster, i, t) if i + 1 < lay.P else 0.0
        out.append({"forward_s": fwd, "backward_s": bwd, "p2p_s": p2p, "T_s": fwd + bwd + p2p, "busy_s": busy})
    return out


def post_step(lay: PipelineLayout, cost: CostModel, cluster: Cluster) -> float:
    """Gradient all-reduce and optimizer step after the pipeline drains (module docstring)."""
    m = cost.model
    gb = cost.settings.dtype_bytes
    post = 0.0
    memo: dict[tuple, float] = {}

    def allreduce(ranks: list[int], nbytes: float) -> float:
        key = (tuple(ranks), nbytes)
        if key not in memo:
            memo[key] = allreduce_time(Links.for_ranks(cluster, ranks, cost.profiles), nbytes)
        return memo[key]

    for i in range(lay.P):
        dense = cost.pipeline_stage_params_per_rank(lay.pieces[i], i == 0, i == lay.P - 1, lay.tp)
        every = [r for g in range(lay.G) for r in lay.attention[g][i]]
        n_att = len(lay.attention[0][i])
        held = [sum(h[j] for h in lay.held[i]) for j in range(len(lay.members(0, i)))]
        done: set[tuple] = set()
        for j, r in enumerate(lay.members(0, i)):
            gpu = lay.gpu_types[r]
            n_exp = held[j]
            pos = j % lay.tp if j < n_att else -1
            key = (gpu, n_exp, pos, j < n_att)
            if j >= n_att and key in done and lay.G == 1:
                continue  # twins: same type, same experts, no replicas to sync
            done.add(key)
            params = n_exp * m.expert_params()
            tm = 0.0
            if j < n_att:
                tm += allreduce(every[pos::lay.tp], dense * gb)
                params += dense
            if lay.G > 1 and n_exp:
                replicas = [lay.members(g, i)[j] for g in range(lay.G)]
                tm += allreduce(replicas, m.expert_params() * n_exp * gb)
            post = max(post, tm + cost.optimizer_time(gpu, params))
    return post


def pipeline_memory(lay: PipelineLayout, cost: CostModel, global_batch: int, zebra: bool = False, waves: int = 1,
                    order: str = "gpipe") -> list[dict]:
    """Per stage: live microbatches, and the peak bytes of its attention and expert ranks (the
    largest of each role in group 0) with the usable memory of their GPU type (module docstring).
    `zebra`: zebra inside the stages in `waves` groups of microbatches in `order`
    (plan.tasks.zebra_tasks): a stage keeps its warm-up groups alive (tasks.wave_warmup), all R
    microbatches in GPipe's order."""
    t, tpe = tokens(lay, cost, global_batch)
    members_dp = lay.G * len(lay.attention[0][0]) // lay.tp  # data x context parallel ranks: the optimizer's shards
    out = []
    for i in range(lay.P):
        alive = lay.R // waves * wave_warmup(order, waves, lay.P, i) if zebra else live_microbatches(lay.P, i, lay.R)
        n_att, n_exp = len(lay.attention[0][i]), len(lay.experts[0][i])
        held = lay.totals[i]  # experts of all the stage's layers, per member
        per = cost.per_expert_bytes(tpe, alive, lay.G)
        work = cost.expert_working_bytes(tpe)
        base = cost.pipeline_attention_rank_bytes(t, alive, lay.pieces[i], i == 0, i == lay.P - 1, lay.tp, members_dp,
                                                  lay.cp)
        worst: dict[str, tuple[float, dict]] = {}  # role -> (shortfall, its row)
        roles = ("attention",) * n_att + ("expert",) * n_exp
        kinds = dict(zip(zip(roles, lay.member_gpus[i], held), range(n_att + n_exp)))  # twins once: a member of each
        members = lay.members(0, i)
        for (role, gpu, n), j in kinds.items():
            r = members[j]
            need = (base if role == Role.ATTENTION else 0.0) + (n * per + work if n else 0.0)
            usable = cost.profile(gpu).usable_memory_bytes
            if role not in worst or need - usable > worst[role][0]:
                worst[role] = (need - usable, {"rank": r, "gpu": gpu, "bytes": need, "usable": usable,
                                               "experts": n})
        out.append({"stage": i, "alive": alive, **{role: x for role, (_, x) in worst.items()}})
    return out


def memory_shortfall(lay: PipelineLayout, cost: CostModel, global_batch: int, zebra: bool = False, waves: int = 1,
                     order: str = "gpipe") -> tuple[float, str] | None:
    """None if every rank fits (DistEP's 1F1B, or `zebra` inside the stages in `waves` groups in
    `order`: pipeline_memory), else (GiB over, why) for the rank furthest over."""
    worst = None
    for row in pipeline_memory(lay, cost, global_batch, zebra, waves, order):
        for role in ("attention", "expert"):
            x = row.get(role)
            if x is None or x["bytes"] <= x["usable"]:
                continue
            over = (x["bytes"] - x["usable"]) / 2**30
            if worst is None or over > worst[0]:
                what = (f"{x['experts']} experts and the routed tokens of {row['alive']} live microbatch(es)"
                        if role == Role.EXPERT else f"its layers and {row['alive']} live microbatch(es) of activations")
                worst = (over, f"pipeline stage {row['stage']} of {lay.P}: an {role} rank ({x['gpu']}) needs "
                               f"{x['bytes'] / 2**30:.1f} GiB > {x['usable'] / 2**30:.1f} GiB usable for {what} "
                               f"(expert recompute {cost.settings.expert_recompute!r})")
    return worst


def price(lay: PipelineLayout, cost: CostModel, cluster: Cluster, global_batch: int) -> PipelineResult:
    """The predicted step of a layout under DistEP inside the stages and 1F1B across them."""
    st = stage_times(lay, cost, cluster, global_batch)
    T = [s["T_s"] for s in st]
    makespan = one_f_one_b_step(T, lay.R)
    post = post_step(lay, cost, cluster)
    step = makespan + post
    busy: dict[str, list[float]] = {}
    for i, s in enumerate(st):
        for r, b in zip(lay.members(0, i), s["busy_s"]):
            busy.setdefault(lay.gpu_types[r], []).append(lay.R * b / step)
    util = {g: sum(v) / len(v) for g, v in busy.items()}
    tokens = float(global_batch) * cost.settings.seq_len
    detail = {"pipeline_stages": lay.P, "stage_times_s": T, "bubble_s": sum(T) - max(T), "post_step_s": post,
              "stage_forward_s": [s["forward_s"] for s in st], "stage_backward_s": [s["backward_s"] for s in st],
              "p2p_s": [s["p2p_s"] for s in st], "stage_moe_layers": [list(x) for x in lay.layers]}
    return PipelineResult(step, tokens / step, makespan, util, None, None, detail)


def lower_bound(cost: CostModel, a_gpus: set[str], x_gpus: set[str], t: float, tpe: float, per_rank_experts: int,
                P: int, R: int, tp: int = 1, cp: int = 1) -> float:
    """A lower bound on price(...).step_time_s without building the layout: the stages' T sum to at
    least one microbatch's attention compute through every piece (the fastest attention type) and
    the busiest expert rank's experts of every layer (`per_rank_experts`, the fastest expert type),
    and step >= sum T + (R - 1) sum T / P."""
    L = cost.num_layers
    attn = min(sum(cost.stage_time(g, s, t, b, tp, cp=cp) for s in range(L + 1) for b in (False, True))
               for g in a_gpus)
    exp = min(cost.expert_time(g, tpe, False) + cost.expert_time(g, tpe, True) for g in x_gpus)
    chain = attn + per_rank_experts * exp
    return chain * (1 + (R - 1) / P) * (1 - 1e-9)


def zebra_bound_terms(cost: CostModel, cluster: Cluster, a_gpus: set[str], x_gpus: set[str], t: float, tpe: float,
                      lay: PipelineLayout, colls: list[list[dict]] | None = None,
                      attention_only: bool = False, streams: bool = True) -> tuple[float, float]:
    """(per-microbatch seconds of the stages before the last, per-microbatch seconds of the last
    stage) in zebra_lower_bound, which is R / W x the first + R x the second (times 1 - 1e-9).
    `streams` False: without the streams' load (a cheaper, weaker bound; so is attention_only)."""
    P = lay.P
    if attention_only or not streams:
        colls = [[{TaskKind.D_F: 0.0, TaskKind.C_F: 0.0, TaskKind.C_B: 0.0, TaskKind.D_B: 0.0} for _ in h]
                 for h in lay.held]
    elif colls is None:
        colls = stage_collectives(lay, cost, cluster, t)

    def attention(i: int, backward: bool) -> float:
        return min(sum(cost.stage_time(g, s, t, backward, lay.tp, dense=d, cp=lay.cp)
                       for n, (s, d) in enumerate(lay.pieces[i]) if not backward or i == 0 or n > 0) for g in a_gpus)

    def experts(i: int, backward: bool) -> float:
        if attention_only:
            return 0.0
        per = min(cost.expert_time(g, tpe, backward) for g in x_gpus)
        n_att = len(lay.attention[0][i])
        busiest = [max(h[n_att:]) for h in lay.held[i]]  # per layer: the busiest expert rank's experts
        return sum(busiest[1:] if backward else busiest[:-1]) * per

    def stream_load(i: int, backward: bool) -> float:  # a stage's phase: its layers but the last (backward: the first)
        layers = colls[i][1:] if backward else colls[i][:-1]
        if backward:
            return max(sum(c[TaskKind.C_B] for c in layers), sum(c[TaskKind.D_B] for c in layers))
        return max(sum(c[TaskKind.D_F] for c in layers), sum(c[TaskKind.C_F] for c in layers))

    before = sum(max(attention(i, b), experts(i, b), stream_load(i, b)) for i in range(P - 1) for b in (False, True))
    last = P - 1
    # every collective of the last stage, per stream
    dispatch = sum(c[TaskKind.D_F] + c[TaskKind.C_B] for c in colls[last])
    combine = sum(c[TaskKind.C_F] + c[TaskKind.D_B] for c in colls[last])
    return before, max(attention(last, False) + attention(last, True), experts(last, False) + experts(last, True),
                       dispatch, combine)


def zebra_lower_bound(cost: CostModel, cluster: Cluster, a_gpus: set[str], x_gpus: set[str], t: float, tpe: float,
                      lay: PipelineLayout, waves: int = 1, colls: list[list[dict]] | None = None,
                      attention_only: bool = False, terms: tuple[float, float] | None = None) -> float:
    """A lower bound on the event simulator's step of zebra inside the stages in `waves` groups of
    microbatches (no task lists built), from the order of plan.tasks.zebra_tasks. A stage after the
    first starts when the one before has run the first group's forward pieces but its last piece
    (the group's first output leaves with it), and its experts that group's layers but the last.
    The last stage runs all its pieces (its first pieces' backward aside) for all R microbatches.
    The last group's gradient then goes back: each stage before the last runs that group's
    backward pieces but its first (stage 0: all), its experts that group's layers but the first.
    These follow one another, each at least its attention rank's or its busiest expert rank's
    compute (the layout's experts on expert ranks, `tpe` tokens each; the fastest type of each
    role; experts an attention rank holds left out), or what its dispatch or its combine stream
    carries meanwhile, one collective at a time (the same layers; `colls`: stage_collectives,
    computed here if not given). `attention_only`: the attention pieces alone, a bound for any
    placement of the experts (Asym-EA only adds work to attention ranks). `terms`:
    zebra_bound_terms, when computed once for several `waves`."""
    before, last = terms or zebra_bound_terms(cost, cluster, a_gpus, x_gpus, t, tpe, lay, colls, attention_only)
    return (lay.R // waves * before + lay.R * last) * (1 - 1e-9)


def check_plan_matches(plan: HeteroPlan, cluster: Cluster, model: ModelConfig) -> None:
    """PlanError unless `plan` is for this cluster (its ranks and their GPU types) and this model
    (its MoE layers, dense layers and experts): what the simulator and this model price it on."""
    if cluster.world_size != plan.world_size:
        raise PlanError(f"plan has {plan.world_size} ranks but cluster {cluster.name!r} has "
                        f"{cluster.world_size}; plan for this cluster or pick the matching cluster")
    ctypes = cluster.gpu_types()
    for r, t in enumerate(plan.gpu_types):
        if ctypes[r] != t:
            raise PlanError(f"rank {r} is {t!r} in the plan but {ctypes[r]!r} in cluster {cluster.name!r}")
    have = (plan.num_layers, sorted(plan.dense_layers), plan.num_experts)
    if have != (model.planned_num_moe_layers, model.planned_dense_layers, model.num_experts):
        def shape(n: int, dense: list[int], e: int) -> str:
            return f"{n} MoE layers x {e} experts" + (f", dense layers {dense}" if dense else "")
        raise PlanError(f"plan is for {shape(*have)} but model {model.name!r} has "
                        f"{shape(model.planned_num_moe_layers, model.planned_dense_layers, model.num_experts)}; "
                        f"plan for this model")


def simulate_pipelined(plan: HeteroPlan, cost: CostModel, cluster: Cluster, global_batch: int,
                       schedule: str | None = None) -> PipelineResult:
    """Predicted step of a plan with pipeline stages (any P; P = 1 prices the DistEP chain R
    times, which the event simulator's DistEP makespan equals). DistEP only: zebra inside
    stages has task lists, which simulator.simulate_plan runs."""
    schedule = schedule or plan.schedule
    if schedule != ScheduleName.DISTEP:
        raise PlanError(f"schedule {schedule!r} with pipeline_stages={plan.pipeline_stages}: the 1F1B model prices "
                        f"DistEP inside pipeline stages; price zebra with simulator.simulate_plan")
    check_plan_matches(plan, cluster, cost.model)
    return price(layout_of_plan(plan), cost, cluster, global_batch)


def pipeline_sizes(model: ModelConfig, sizes: tuple[int, ...] = PIPELINE_STAGES) -> dict[int, str]:
    """Each pipeline size with '' if the model can be split into that many stages, else why not."""
    out = {}
    for P in sizes:
        try:
            model_pieces(model, P)
            out[P] = ""
        except PlanError as e:
            out[P] = str(e)
    return out
