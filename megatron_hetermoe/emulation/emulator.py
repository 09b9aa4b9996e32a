"""Emulate a mixed GPU cluster on CPU ranks, and know when the emulation is not to be trusted.

Each rank gets the GPU type of its position in a cluster file. Every compute task runs its real
computation on the small model, then waits until the time the cost model gives for the
*emulated* model shape on that GPU type has passed; every transfer likewise waits for its bytes
over the emulated links. All times are multiplied by `scale` (real seconds per emulated
second). The same rules time plain Megatron EP, through hooks on megatron-core's modules
(attention, experts, output layer) and its token all-to-all, so HeterMoE and the baselines are
measured alike, and each can be compared with the simulator's prediction for the same plan.

Real loads. An emulated expert task (X_*, E_*) lasts the cost model's time for the tokens its
experts really received in that microbatch, scaled to the emulated shape (each expert's tokens
over the layer's mean, times the balanced share: `expert_task_time`), and so do Megatron EP's
emulated experts (emulation/megatron_ep.py): an emulated step includes the router's skew. A
HeterMoE token transfer lasts the collective's time for the rows each member really sent each
member (`transfer_task_time`). Megatron EP's all-to-alls and the predicted step
(`predict_hetero`, the clock's reference) stay balanced.

Validity. Emulation holds only while the real work fits inside the emulated time. Each window
(a compute task, a transfer, the post-step, a Megatron EP segment) begins when it could, as in
the simulator: when its inputs were there and its lane free (a collective: when its last member
could begin it); everything the host does from then on (reaching the task, the real compute or
gloo call) runs inside its budget (emulated seconds x scale), and the window closes when the
budget has passed. Each rank records every window: its start, budget, when its real work ended
and when it closed. A window's *delay* is what it added over an exact emulation: the real work
that overran the budget, and a late wake-up:
    delay = max(0, real_end - (start + budget)) + (end - max(start + budget, real_end)).
The simulator, run on the task graph with each task lasting its budget plus its delay, minus the
same run on the budgets alone, gives how much later the task lists ended than an exact emulation
would have (for Megatron EP, whose ranks meet at every stage boundary, the sum over windows of
the latest rank's budget plus delay, minus the longest budget); with the post-step's delay and
the step-level slack (ranks starting the step apart, the loss all-reduce after the post-step)
this bounds how much later the step ended. A run whose bound exceeds `max_overrun` (3 %) of the
predicted step is *invalid*: its times say more about the host's CPUs than about the emulated
cluster, and it names the fix.

Scale. With `auto_scale`, the ranks run a warm-up step at the initial scale, stretch the next
one (the calibration step) so that each rank's real work fills at most a quarter of it, measure
there each window's real work and host delay, and pick the smallest scale at which the bound,
with the real work taken 1.5x longer (load varies), stays under `target_overrun` (1 %) of the
step; every later step runs at that scale.
"""
from __future__ import annotations

from megatron_hetermoe.config import EmulationSpec, ModelConfig
from megatron_hetermoe.emulation.clock import EmulationClock
from megatron_hetermoe.emulation.validity import _Bulk, _TaskGraph
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import (
    CostModel,
    TrainSettings,
    runtime_program,
)
from megatron_hetermoe.planner.profiles import load_profiles


class Emulator:
    def __init__(self, spec: EmulationSpec):
        self.spec = spec
        self.cluster = Cluster.load(spec.cluster)
        self.model = ModelConfig.load(spec.model).replace(seq_length=spec.seq_len)
        if self.model.beyond_every_layer_moe:  # emulated runs train on the plugin's own trainer
            raise ValueError(f"emulated model {self.model.name!r} has "
                             f"{' and '.join(self.model.beyond_every_layer_moe)}: "
                             f"emulated runs train on the plugin's own trainer, which builds every layer as an MoE "
                             f"layer without shared experts; `hetermoe plan` prices such a model")
        self.profiles = load_profiles(set(self.cluster.gpu_types()))
        self.cost = CostModel(self.model, self.profiles, TrainSettings(spec.seq_len, spec.activation_checkpointing))

    def gpu(self, rank: int) -> str:
        return self.cluster.gpu_types()[rank]

    def programs(self, recompute: bool = False) -> dict:
        """Which program the times are for (per GPU type), and which one the CPU ranks really run."""
        return {"predicted_program": self.cost.programs(), "runtime_program": runtime_program(recompute).describe()}

    def check_real_model(self, real: ModelConfig) -> None:
        m = self.model
        if ((real.num_layers, real.num_experts, real.moe_router_topk)
                != (m.num_layers, m.num_experts, m.moe_router_topk)):
            raise ValueError(
                f"the real model {real.name!r} has {real.num_layers} layers x {real.num_experts} experts, top-"
                f"{real.moe_router_topk}, but the emulated {m.name!r} has {m.num_layers} x {m.num_experts}, top-"
                f"{m.moe_router_topk}; emulation keeps layers and experts and shrinks only the widths: use "
                f"emulation_real_model({m.name!r})")

    def check_plan(self, plan) -> None:
        types = self.cluster.gpu_types()
        if plan.world_size != len(types):
            raise ValueError(f"plan has {plan.world_size} ranks but emulated cluster {self.cluster.name!r} has "
                             f"{len(types)}; plan for this cluster (hetermoe plan --cluster {self.cluster.name})")
        for r, (a, b) in enumerate(zip(plan.gpu_types, types)):
            if a.lower() != b.lower():
                raise ValueError(f"rank {r} is {a!r} in the plan but {b!r} in cluster {self.cluster.name!r}")

    # ---- HeterMoE --------------------------------------------------------------------------
    def task_times(self, plan, rank: int, schedule: str) -> dict:
        """Emulated seconds of each task of `rank` (not scaled), with pipeline stages also of each
        transfer between stages it sends or receives (plan.tasks.PipeTask)."""
        from megatron_hetermoe.planner.simulator import rank_task_times

        return dict(rank_task_times(plan, self.cost, self.cluster, self.spec.global_batch, rank, schedule,
                                    with_transfers=True))

    def hetero_clock(self, plan, schedule: str, group, recompute: bool = False) -> EmulationClock:
        """The clock of a HeterMoE rank (the same on every rank)."""
        pred, post, bound = self.hetero_phase(plan, schedule)
        return EmulationClock(self.spec, pred, post, group, bound, self.programs(recompute))

    def hetero_phase(self, plan, schedule: str) -> tuple[float, float, _TaskGraph]:
        """What the clock judges a HeterMoE step of `plan` by: its predicted step, its post-step
        and the task graph of the validity bound (EmulationClock.follow takes them after a live
        move: the steps after it are judged on the new plan's lists)."""
        from megatron_hetermoe.planner.simulator import build_problem

        gb = self.spec.global_batch
        post = max(build_problem(plan, self.cost, self.cluster, gb, schedule).post_step)
        problems = [build_problem(plan, self.cost, self.cluster, gb, schedule, group=g, dedup=False)
                    for g in range(len(plan.groups))]
        pred = self.predict_hetero(plan, schedule).step_time_s
        return pred, post, _TaskGraph(problems, list(range(plan.world_size)))

    def task_timing(self, plan, rank: int, schedule: str, clock: EmulationClock | None = None):
        """The executors' task times of `rank` (emulation/timing.py): each task's emulated time on
        the rank's GPU and links, at the clock's current scale."""
        from megatron_hetermoe.emulation.timing import EmulatedTiming

        times = self.task_times(plan, rank, schedule)
        scale = (lambda: clock.scale) if clock is not None else (lambda: self.spec.scale)
        expert = self.expert_task_time(plan, rank)
        transfer = self.transfer_task_time(plan, rank)
        return EmulatedTiming(lambda t: times[t] * scale(), clock, lambda t, got: expert(t, got) * scale(),
                              lambda t, rows: transfer(t, rows) * scale())

    def expert_task_time(self, plan, rank: int):
        """(task, ReceivedTokens) -> emulated seconds of an expert task of `rank` whose experts
        received those tokens: each expert runs the balanced share of the emulated shape times its
        multiplier (its tokens over the layer's mean in that microbatch), so the real model's
        routing skew is priced on the emulated model; balanced routing gives task_times' time."""
        from megatron_hetermoe.planner.simulator import balanced_tokens_per_expert, experts_time

        share = balanced_tokens_per_expert(plan, self.cost, self.spec.global_batch)
        gpu = self.gpu(rank)
        return lambda task, got: experts_time(self.cost, gpu, [share * m for m in got.multipliers()],
                                              task.kind.endswith("_B"))

    def transfer_task_time(self, plan, rank: int):
        """(task, rows) -> emulated seconds of a token transfer (D_F, C_F, C_B, D_B) of `rank`'s ZP
        group (its stage's members) whose members sent each other `rows` in the dispatch direction
        (Route.pair_rows, comm order: ascending rank): the rows scaled to the emulated
        microbatch's routed tokens (each attention rank's tokens x top-k) and priced as the
        simulator prices a collective (planner/cluster.collective_time, the same links). Balanced
        rows give task_times' time; a member that receives more waits longer, and so does every
        member (the collective ends with it)."""
        from megatron_hetermoe.planner.cluster import Links, collective_time
        from megatron_hetermoe.planner.simulator import tokens_per_microbatch
        from megatron_hetermoe.vocabulary import TaskKind

        group, stage = plan.group_of(rank), plan.stage_of(rank)
        members = sorted(plan.stage_members(group, stage))
        links = Links.for_ranks(self.cluster, members, self.cost.profiles)
        attention = len(plan.stage_ranks(group, stage)[0])
        t_mb = tokens_per_microbatch(plan, float(self.spec.global_batch) * self.cost.settings.seq_len)
        routed = attention * t_mb * self.model.moe_router_topk  # the emulated microbatch's rows
        token_bytes = self.cost.token_bytes()
        resend = 2.0 if self.cost.settings.expert_recompute == "resend-inputs" else 1.0

        def price(task, rows) -> float:
            total = sum(map(sum, rows))
            if total <= 0:
                return 0.0
            per_row = routed / total * token_bytes * (resend if task.kind == TaskKind.C_B else 1.0)
            n = len(rows)
            to_experts = task.kind in (TaskKind.D_F, TaskKind.C_B)
            nbytes = [[(rows[i][j] if to_experts else rows[j][i]) * per_row for j in range(n)] for i in range(n)]
            return collective_time(links, nbytes)
        return price

    def move_seconds(self, experts: int) -> float:
        """Estimated seconds of a live move of `experts` (layer, expert) copies on the emulated
        cluster (the CPU ranks move the small model's states, whose time says nothing of it): each
        copy's parameter, fp32 main parameter and two Adam moments over the slowest NIC, in series
        (an upper bound: copies between different pairs of ranks overlap)."""
        state_bytes = self.model.expert_params() * (self.cost.settings.dtype_bytes + 12)
        return experts * state_bytes / (min(self.cluster.nic_gbs()) * 1e9)

    def replan(self, margin: float):
        """The live-move decision of an emulated run (training/replan.py): planner/rebalance's
        propose_simulated on the emulated cluster and shape, a move costed by move_seconds (the
        CPU ranks' measured move says nothing of the emulated cluster's: the Replanner's cost is
        not used)."""
        from megatron_hetermoe.planner.rebalance import RebalanceConfig, propose_simulated

        cfg = RebalanceConfig(margin=margin)
        return lambda plan, tokens, next_steps, _measured_cost=None: propose_simulated(
            plan, tokens, next_steps, self.cost, self.cluster, self.spec.global_batch,
            lambda n: self.move_seconds(n * len(plan.groups)), cfg)

    def predict_hetero(self, plan, schedule: str):
        from megatron_hetermoe.planner.simulator import simulate_plan

        return simulate_plan(plan, self.cost, self.cluster, self.spec.global_batch, schedule=schedule)

    # ---- plain Megatron EP ------------------------------------------------------------------
    def predict_ep(self, ranks: list[int] | None = None, name: str = "EP"):
        from megatron_hetermoe.planner.baselines import simulate_ep

        b = self.spec.global_batch if ranks is None else self.spec.global_batch * len(ranks) // self.cluster.world_size
        return simulate_ep(self.cost, self.cluster, b, ranks, name)

    def ep_clock(self, prediction, group) -> EmulationClock:
        return EmulationClock(self.spec, prediction.step_time_s, prediction.detail["post_step_s"], group, _Bulk(),
                              self.programs(False))


def emulation_real_model(emulated: str | ModelConfig, hidden: int = 64, seq_length: int = 32) -> ModelConfig:
    """The small model that really runs while `emulated` is emulated: same layers, experts and
    top-k (the task lists and placements depend on them), tiny widths."""
    m = emulated if isinstance(emulated, ModelConfig) else ModelConfig.load(emulated)
    return m.replace(name=f"{m.name}-emulated-by-tiny", hidden_size=hidden, num_attention_heads=4,
                     ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden, vocab_size=256,
                     seq_length=seq_length)
