"""The plugin's HeterMoE trainer: attention ranks run Megatron's own schedule with HeteroMoELayer
(DistEP) or the zebra schedule; expert ranks run the mirror of either; both step their Megatron
optimizers in lockstep on one global gradient norm.

Data flows one way: plan -> process groups (parallel/state.py) -> the rank's assembly
(training/assembly.py: model per role, optimizer, schedule, the same pieces Megatron-LM's
pretrain() hooks use) -> step (training/loop.py). Megatron's initialize_model_parallel is never
called: every megatron-core piece gets an explicit ProcessGroupCollection, so a missed global
read fails fast instead of joining a world-wide collective the expert ranks never enter.
"""
from __future__ import annotations

import dataclasses
import re
import resource

import torch
import torch.distributed as dist

from megatron_hetermoe.checkpoint.hooks import hetero_checkpointer, hetero_rank_state
from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.data.dataset import make_data
from megatron_hetermoe.models.builder import (
    KernelChoice,
    RankEnv,
    block_spec,
    choose_fusions,
    choose_kernels,
    gather_rank_envs,
    gpt_kwargs,
    precision_dtype,
    router_expert_bias,
    transformer_config,
    wrap_precision,
)
from megatron_hetermoe.parallel.device import (
    check_native_bf16,
    peak_gpu_mib,
    rank_device,
    reset_peak_memory,
)
from megatron_hetermoe.parallel.megatron_globals import megatron_globals
from megatron_hetermoe.parallel.state import (
    HeteroParallelState,
    initialize_hetero_parallel,
)
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.plan.layout import hetero_to_megatron, load_params
from megatron_hetermoe.schedules.select import ExecutedSteps
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.shims import torch_distributed
from megatron_hetermoe.training.assembly import RoleAssembly, model_config
from megatron_hetermoe.training.expert_load_log import ExpertLoadLog, stats_path
from megatron_hetermoe.training.logging import StepLogger, last_step_busy
from megatron_hetermoe.training.loop import LoopParts, train_loop
from megatron_hetermoe.training.nan_check import NanGuard
from megatron_hetermoe.training.result import TrainResult
from megatron_hetermoe.training.run_hooks import RunHooks
from megatron_hetermoe.training.step import batch_to, forward_step, loss_scale_of
from megatron_hetermoe.vocabulary import Role


class HeteroStep:
    """A HeterMoE rank's part of the loop. Attention ranks feed microbatches to the schedule;
    expert ranks mirror it. Megatron's optimizer then takes the exact global gradient norm over
    the world and clips by it (RoleAssembly.configure_optimizer), as Megatron clips one model."""

    def __init__(self, cfg: TrainConfig, hooks: RunHooks, assembly: RoleAssembly, model, module, fwd_bwd, nmb: int,
                 optimizer, executed: ExecutedSteps | None = None):
        self.cfg, self.hooks, self.assembly = cfg, hooks, assembly
        self.executed = executed  # the schedule's report; its activation peak is read for the last step
        self.hs, self.model, self.module, self.fwd_bwd, self.nmb = assembly.hs, model, module, fwd_bwd, nmb
        self.optimizer = optimizer
        self.pgc = self.hs.pg_collection()
        self.data = make_data(cfg)
        self.grads: list[dict] = []

    def before_step(self, it: int) -> None:
        if self.executed is not None:
            self.executed.meter = it == self.cfg.train_iters - 1
        if self.hooks.pin_params is not None:
            load_params(self.module, self.assembly.local_state(self.module, self.hooks.pin_params[it]))

    def forward_backward(self, it: int):
        cfg, nmb, hs = self.cfg, self.nmb, self.hs
        tot = torch.zeros(2, device=hs.device)
        if hs.role == Role.ATTENTION:
            d = hs.attention_dp_rank
            batches = iter([self._this_cp_rank(batch_to(self.data.microbatch(it, d * nmb + m, cfg.micro_batch_size,
                                                                             cfg.global_batch_size), hs.device))
                            for m in range(nmb)])
            reduced = self.fwd_bwd(forward_step_func=forward_step, data_iterator=batches, model=[self.model],
                                   num_microbatches=nmb, seq_length=cfg.model.seq_length,
                                   micro_batch_size=cfg.micro_batch_size, forward_only=False,
                                   pg_collection=self.pgc)
            for r in reduced:
                tot += r["lm loss"]
        else:
            self.fwd_bwd(model=[self.model], num_microbatches=nmb)
        self.assembly.finish_gradients(self.model)
        self.tot = tot
        return [tot]

    def local_loss(self):
        return self.tot

    def _this_cp_rank(self, batch: dict) -> dict:
        """A member's microbatch cut to this rank's two of the sequence's 2 x CP chunks (Megatron's
        get_batch_on_this_cp_rank, as Megatron-LM's get_batch does); the batch itself at CP 1."""
        if self.hs.plan.attention_cp == 1:
            return batch
        from megatron_hetermoe.compat import batch_on_this_cp_rank

        return batch_on_this_cp_rank(batch, self.hs.megatron_group("cp"))

    def adopt(self, rb: "RankBuild", fwd_bwd) -> None:
        """Run on a live move's rebuilt objects (training/replan.py) from the next step on."""
        self.model, self.module, self.names, self.optimizer = rb.model, rb.module, rb.names, rb.optimizer
        self.fwd_bwd = fwd_bwd

    def before_optimizer(self) -> None:
        if self.hooks.collect_grads:
            # Before Megatron's optimizer unscales and clips: the unscaled gradients, as Megatron
            # EP's trainer reports them.
            self.grads.append(export_megatron(self.hs, self.model, "main_grad",
                                              scale=1.0 / loss_scale_of(self.optimizer)))
        return None  # the norm is Megatron's optimizer's (over the world)


def train_hetero(cfg: TrainConfig, plan: HeteroPlan, run: HeteroRunConfig | None = None,
                 hooks: RunHooks | None = None) -> TrainResult:
    """Train on the current world with `plan` (run.schedule: the plan's, or another; run.timeline_dir:
    each rank writes its timeline there). `hooks`: build-time objects and test seams."""
    from megatron_hetermoe.training.validation import check_hetero

    run = run or HeteroRunConfig()
    hooks = hooks or RunHooks()
    check_hetero(cfg, plan, dist.get_world_size(), run.schedule, run)  # validate_job's check, for library callers
    schedule = run.schedule or plan.schedule
    pools = run.pools(cfg)
    emulator = None
    if cfg.emulate is not None:
        from megatron_hetermoe.emulation.emulator import Emulator

        emulator = Emulator(cfg.emulate)
        emulator.check_real_model(cfg.model)
        emulator.check_plan(plan)
    nmb = plan.num_microbatches
    torch_distributed.trace_collectives()  # $HETERMOE_TRACE_COLLECTIVES: every collective's order, to check
    hs = initialize_hetero_parallel(plan, device=hooks.device or rank_device(), wire_dtype=precision_dtype(pools.wire))
    if hooks.transport is not None:
        hs.transport = hooks.transport(hs)  # before anything holds the state's own
    assembly = RoleAssembly(hs, pools)
    precision = pools.of(hs.role)  # this rank's pool's
    if pools.mixed and hs.rank == 0 and not cfg.quiet:
        scale = "dynamic" if pools.dynamic_scale(cfg.loss_scale) else f"constant {cfg.loss_scale}"
        print(f" precision: attention ranks {pools.attention}, expert ranks {pools.expert}, tokens cross in "
              f"{pools.wire}, one {scale} loss scale", flush=True)
    if precision == "bf16":
        check_native_bf16(hs.device)
    envs = gather_rank_envs(hs.device, hs.group("world"))
    kernels = pool_kernels(cfg, plan, pools, envs, quiet=cfg.quiet)[hs.role]
    fusions = choose_fusions(envs[hs.rank], kernels.name, hs.role)
    with megatron_globals(hs, cfg.seed):
        torch.manual_seed(cfg.seed)
        rb = build_rank(cfg, hooks, assembly, kernels, fusions, hooks.init_state)
        module, names, model, optimizer, scheduler, guard = (rb.module, rb.names, rb.model, rb.optimizer,
                                                             rb.scheduler, rb.guard)
        # Every step's events only for a timeline to write; else the current step's (utilization).
        recorder = TimelineRecorder(hs.rank, hs.role, keep_history=run.timeline_dir is not None)
        loads = ExpertLoadLog(hs, [plan.role(r) for r in range(plan.world_size)], stats_path(run), recorder,
                              writes=dist.get_rank() == 0)
        steplog = StepLogger(cfg, hs.role, recorder, hs.group("world"), dist.get_rank() == 0, loads)
        # The last step's order and activation peak (only that step is metered: HeteroStep.before_step).
        executed = ExecutedSteps(maxlen=1, meter=False)
        clock, task_timing = None, hooks.task_timing
        if emulator is not None:
            clock = emulator.hetero_clock(plan, schedule, hs.group("world"), run.recompute)
            task_timing = emulator.task_timing(plan, hs.rank, schedule, clock)
        run = dataclasses.replace(run, schedule=schedule)
        fwd_bwd = assembly.schedule(run, recorder, executed, task_timing)
        role = HeteroStep(cfg, hooks, assembly, model, module, fwd_bwd, nmb, optimizer, executed)
        role.names = names
        parts = LoopParts(cfg, model, optimizer, scheduler, guard, recorder, steplog,
                          hetero_checkpointer(cfg, hs, module, names, optimizer, scheduler, pools.expert),
                          hs.group("world"), clock)
        if run.replan_interval:
            from megatron_hetermoe.training.replan import Replanner

            def rebuild(states: dict) -> None:
                """The rank's objects for hs's (new) plan, from whole parameter states."""
                new = build_rank(cfg, hooks, assembly, kernels, fusions, {n: st.param for n, st in states.items()},
                                 carry=parts)
                carry_buffers(role.module, new.module)
                timing = task_timing
                if emulator is not None:  # the emulated times and the validity rules follow the new plan
                    timing = emulator.task_timing(hs.plan, hs.rank, schedule, clock)
                    clock.follow(*emulator.hetero_phase(hs.plan, schedule))
                role.adopt(new, assembly.schedule(run, recorder, executed, timing))
                parts.model, parts.optimizer, parts.scheduler, parts.guard = (new.model, new.optimizer,
                                                                              new.scheduler, new.guard)
                parts.checkpointer.state = hetero_rank_state(cfg, hs, new.module, new.names, new.optimizer,
                                                             new.scheduler, pools.expert)
                return new

            if emulator is not None:
                decide = emulator.replan(run.replan_margin)
            else:
                from megatron_hetermoe.planner.rebalance import RebalanceConfig, run_pricing

                decide = run_pricing(plan, cfg.model, cfg.model.seq_length, cfg.global_batch_size,
                                     cfg.use_distributed_optimizer, run.recompute,
                                     RebalanceConfig(margin=run.replan_margin))
            parts.after_step = Replanner(hs, run, hooks.replan, loads, role, parts, rebuild, decide)
        reset_peak_memory(hs.device)  # the GPU peak counts from here (model and optimizer already allocated)
        res = train_loop(parts, role)
        model, module = role.model, role.module  # the last plan's, after live moves
        gpu = peak_gpu_mib(hs.role, hs.device, hs.group("world"))  # before the exports below; None on CPU ranks
        emulation = clock.report() if clock is not None else None
        params = export_megatron(hs, model, "data") if hooks.collect_grads else None
        if run.timeline_dir is not None:
            recorder.save(run.timeline_dir)
        peak = [None] * dist.get_world_size()
        dist.all_gather_object(peak, (hs.role, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                               group=hs.group("world"))
        return TrainResult(
            losses=res.losses, step_times=res.step_times, start_iteration=res.start_iteration, num_microbatches=nmb,
            dp=plan.num_attention_members, skipped=guard.skipped, loss_scales=res.loss_scales,
            overflow_skipped=res.overflow_skipped, grad_norms=res.grad_norms,
            param_dtypes=sorted({str(p.dtype) for p in module.parameters()}),
            kernels=kernels.name, kernels_reason=kernels.reason,
            busy_s=last_step_busy(recorder, cfg.train_iters - 1, hs.group("world")), emulation=emulation,
            peak_gpu_mib=gpu, params=params, grads=role.grads, schedule=schedule,
            executed=[(list(a), {k: list(v) for k, v in b.items()}) for a, b, _ in executed],
            peak_activation_mib=max((m for _, _, m in executed if m is not None), default=0) / 2**20,
            peak_rss_mib=peak, moves=parts.after_step.moves if parts.after_step is not None else [],
            stays=parts.after_step.stays if parts.after_step is not None else [],
            plan=hs.plan.to_dict() if run.replan_interval else None,
            router_expert_bias=router_expert_bias(module, role.names))


@torch.no_grad()
def carry_buffers(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Copy the old module's buffers into the rebuilt one where both have them (the router's
    expert bias under aux-loss-free balancing and its token counts live on attention ranks, which
    a move does not change, but a rebuild would reset)."""
    mine = dict(old.named_buffers())
    for n, b in new.named_buffers():
        o = mine.get(n)
        if o is not None and o.shape == b.shape:
            b.copy_(o)


@dataclasses.dataclass
class RankBuild:
    """A rank's objects that depend on its plan: built once at start, again by each live move
    (training/replan.py)."""
    module: torch.nn.Module
    names: dict[str, str]
    model: object  # Megatron's DDP
    optimizer: object
    scheduler: object
    guard: NanGuard
    opt_config: object


def build_rank(cfg: TrainConfig, hooks: RunHooks, assembly: RoleAssembly, kernels: KernelChoice, fusions,
               init_state: dict | None, carry=None) -> RankBuild:
    """The rank's module (from `init_state`, canonical names, or the layout-invariant init), its
    DDP, Megatron's optimizer and LR schedule and the NaN guard, for assembly.hs's plan. `carry`:
    the LoopParts of the objects this build replaces (a live move): the schedule's position, the
    loss scale and the NaN guard's record carry over; the optimizer's state is the caller's."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.utils import get_pg_rank

    from megatron_hetermoe.training.expert_move import carry_loss_scale, rebuild_config
    from megatron_hetermoe.training.step import build_optimizer

    hs, pools = assembly.hs, assembly.pools
    precision = pools.of(hs.role)
    pgc = hs.pg_collection()
    # The plan gives the role's parallel sizes (model_config); the run's config its CP communication.
    par = ParallelConfig(cp_comm_type=cfg.parallel.cp_comm_type)
    config = model_config(transformer_config(cfg.model, par, precision, kernels=kernels.name,
                                             fusions=fusions, deterministic_mode=cfg.deterministic), hs)
    spec = block_spec(cfg.model, kernels.name, config, get_pg_rank(pgc.pp), hs.device)
    # A live move loads every parameter from the moved states: no random init (expert_move.rebuild_config).
    built = rebuild_config(config) if carry is not None else config
    module, names = assembly.module(built, spec, cfg.seed, gpt_kwargs(cfg.model), init_state)
    if carry is not None:
        config = built
    module.to(hs.device)  # built and initialized on the CPU (use_cpu_initialization)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=cfg.use_distributed_optimizer)
    # bf16/fp16: Float16Module on both roles (the expert ranks' ExpertRuntime too), as
    # Megatron-LM's get_model wraps a chunk before DDP.
    model = DistributedDataParallel(config, ddp_config, wrap_precision(config, module), pg_collection=pgc)
    guard = NanGuard(cfg.nan_check_mode(pools), [model],
                     {p: names[n] for n, p in module.named_parameters()}, hs.rank, hs.role,
                     hs.group("world"), hooks.nan_injection, device=hs.device)
    optimizer, scheduler, opt_config = build_optimizer(cfg, model, cfg.clip_grad, cfg.use_distributed_optimizer,
                                                       pg_collection=pgc, precision=precision)
    optimizer = assembly.configure_optimizer(optimizer, opt_config)
    scheduler.optimizer = optimizer
    if carry is not None:
        scheduler.load_state_dict(carry.scheduler.state_dict())
        carry_loss_scale(carry.optimizer, optimizer)
        guard.skipped, guard.iteration = carry.guard.skipped, carry.guard.iteration
    if hs.role == Role.ATTENTION:
        config.finalize_model_grads_func = lambda m, n=None, pg_collection=None, force_all_reduce=False: \
            finalize_model_grads(m, n, pg_collection=pgc, force_all_reduce=force_all_reduce)
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = model.no_sync
    return RankBuild(module, names, model, optimizer, scheduler, guard, opt_config)


def pool_kernels(cfg: TrainConfig, plan: HeteroPlan, pools, envs: list[RankEnv],
                 quiet: bool = True) -> dict[str, KernelChoice]:
    """Each pool's kernels (models.builder.choose_kernels' pool rule: the attention ranks and the
    expert ranks each run one choice, in the pool's precision, from every rank's gathered RankEnv).
    Every rank computes both pools', so a choice that cannot run fails on every rank alike. The
    first rank prints them on CUDA ranks, where the pool's GPUs may choose otherwise than the
    check before launch did (CPU ranks: the same choice, already printed)."""
    out = {role: choose_kernels(envs[ranks[0]].device, pools.of(role), cfg.transformer_impl, cfg.moe_grouped_gemm,
                                [envs[r] for r in ranks])
           for role, ranks in (("attention", plan.attention_ranks), ("expert", plan.expert_ranks)) if ranks}
    if not quiet and dist.get_rank() == 0 and envs[0].cuda:
        for role, choice in out.items():
            print(f" {role} ranks: {choice.line()}", flush=True)
    return out


_UNWRAP = re.compile(r"^(?:module\.)+")  # DDP's and Float16Module's prefixes


def export_megatron(hs: HeteroParallelState, model, attr: str = "data", scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Every rank's parameters (or main_grad) merged into a plain Megatron state dict, on all
    ranks (plan.layout.hetero_to_megatron over an all_gather)."""
    from megatron_hetermoe.models import tp_shards
    from megatron_hetermoe.models.builder import unwrap

    # Each TP rank of a member sends whole tensors (its shards gathered over the member's TP group).
    tp = hs.megatron_group("tp")
    glu = bool(getattr(getattr(unwrap(model), "config", None), "gated_linear_unit", False))
    specs = tp_shards.module_specs(model, tp, glu)
    # CPU copies: a pickled CUDA tensor would unpickle onto the sender's GPU.
    local = {_UNWRAP.sub("", n): tp_shards.gathered(getattr(p, attr).detach().clone().float() * scale, specs[n],
                                                    tp).cpu()
             for n, p in model.named_parameters()}
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, local, group=hs.group("world"))
    return hetero_to_megatron(world, hs.plan)
