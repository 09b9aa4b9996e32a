"""The HeterMoE trainer: attention ranks run Megatron's own schedule with HeteroMoELayer
(DistEP) or the zebra schedule; expert ranks run the mirror of either; both step their Megatron
optimizers in lockstep on one global gradient norm.

Data flows one way: plan -> process groups (parallel/state.py) -> model per role
(models/) -> schedule (schedules/) -> step (training/step.py, loop.py). Megatron's
initialize_model_parallel is never called: every megatron-core piece gets an explicit
ProcessGroupCollection, so a missed global read fails fast instead of joining a world-wide
collective the expert ranks never enter.
"""
from __future__ import annotations

import collections
import re
import resource

import torch
import torch.distributed as dist

from megatron_hetermoe.checkpoint.hooks import hetero_checkpointer
from megatron_hetermoe.config import (
    HeteroRunConfig,
    ParallelConfig,
    TrainConfig,
    ZebraConfig,
)
from megatron_hetermoe.data.dataset import make_data
from megatron_hetermoe.models.builder import (
    build_gpt,
    canonical_names,
    choose_kernels,
    init_layout_invariant,
    layer_spec,
    precision_dtype,
    transformer_config,
    wrap_precision,
)
from megatron_hetermoe.models.experts import ExpertRuntime
from megatron_hetermoe.models.moe_layer import hetero_layer_spec
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
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.plan.layout import (
    hetero_to_megatron,
    load_params,
    megatron_to_hetero,
)
from megatron_hetermoe.reliability import collective_trace
from megatron_hetermoe.reliability.nan_check import NanGuard
from megatron_hetermoe.schedules.select import get_forward_backward_func
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.training.logging import StepLogger, last_step_busy
from megatron_hetermoe.training.loop import LoopParts, train_loop
from megatron_hetermoe.training.step import (
    batch_to,
    clip_coefficient,
    forward_step,
    global_grad_norm,
    loss_scale_of,
    share_loss_scale,
)


def _is_expert_param(p) -> bool:
    return not getattr(p, "allreduce", True)


def average_expert_grads(hs: HeteroParallelState, model) -> None:
    """An expert rank's share of Megatron's data-parallel average. Each expert saw the tokens of
    the M attention ranks of its ZP group, each a local-mean loss: Megatron's average needs
    1/(M*G); DDP applied 1/G over the replica group."""
    for p in model.parameters():
        p.main_grad.mul_(1.0 / hs.num_attention_per_group)


class HeteroStep:
    """A HeterMoE rank's part of the loop. Attention ranks feed microbatches to the schedule;
    expert ranks mirror it. Both sides then compute the exact global gradient norm (dense
    parameters owned by attention DP rank 0, experts by ZP group 0) and clip by it, as Megatron
    clips one model."""

    def __init__(self, cfg: TrainConfig, hs: HeteroParallelState, model, module, fwd_bwd, nmb: int, optimizer):
        self.cfg, self.hs, self.model, self.module, self.fwd_bwd, self.nmb = cfg, hs, model, module, fwd_bwd, nmb
        self.optimizer = optimizer
        self.pgc = hs.pg_collection()
        self.data = make_data(cfg)
        self.grads: list[dict] = []

    def before_step(self, it: int) -> None:
        if self.cfg.pin_params is not None:
            load_params(self.module, megatron_to_hetero(self.cfg.pin_params[it], self.hs.plan, self.hs.rank))

    def forward_backward(self, it: int):
        cfg, nmb, hs = self.cfg, self.nmb, self.hs
        tot = torch.zeros(2, device=hs.device)
        if hs.role == "attention":
            d = hs.attention_dp_rank
            batches = iter([batch_to(self.data.microbatch(it, d * nmb + m, cfg.micro_batch_size,
                                                          cfg.global_batch_size), hs.device)
                            for m in range(nmb)])
            reduced = self.fwd_bwd(forward_step_func=forward_step, data_iterator=batches, model=[self.model],
                                   num_microbatches=nmb, seq_length=cfg.model.seq_length,
                                   micro_batch_size=cfg.micro_batch_size, forward_only=False,
                                   pg_collection=self.pgc)
            for r in reduced:
                tot += r["lm loss"]
        else:
            self.fwd_bwd(model=[self.model], num_microbatches=nmb)
        self.tot = tot
        return [tot]

    def local_loss(self):
        return self.tot

    def before_optimizer(self) -> float:
        hs = self.hs
        if hs.role == "expert":
            average_expert_grads(hs, self.model)
        grads = [(p.main_grad, _is_expert_param(p)) for p in self.model.parameters()]
        owned = [g for g, is_expert in grads if hs.owns_gradient(is_expert)]
        # The gradients carry the world's one loss scale (training/step.py share_loss_scale); the
        # norm and the clip are of the unscaled ones, as Megatron clips after unscaling.
        scale = loss_scale_of(self.optimizer)
        grad_norm = global_grad_norm(owned, hs.world_group, hs.device)
        if scale != 1.0:
            grad_norm /= scale
        coeff = clip_coefficient(self.cfg.clip_grad, grad_norm)
        if coeff < 1.0:
            for g, _ in grads:
                g.mul_(coeff)
        if self.cfg.collect_grads:
            # Reported before clipping, as Megatron's main_grad is before its step clips.
            self.grads.append(export_megatron(hs, self.model, "main_grad", scale=1.0 / (coeff * scale)))
        return grad_norm


def train_hetero(cfg: TrainConfig, plan: HeteroPlan, run: HeteroRunConfig | None = None,
                 zebra_config: ZebraConfig | None = None) -> dict:
    """Train on the current world with `plan` (run.schedule: the plan's, or "distep"/"zebra";
    run.timeline_dir: each rank writes its timeline there). zebra_config overrides the zebra
    runtime options run.recompute sets (tests time tasks with it)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_hetermoe.training.step import build_optimizer

    run = run or HeteroRunConfig()
    zebra_config = zebra_config or ZebraConfig(recompute=run.recompute, issuer=run.zebra_issuer)
    mcfg = cfg.model
    if plan.num_layers != mcfg.num_layers or plan.num_experts != mcfg.num_experts:
        raise PlanError(
            f"plan is for {plan.num_layers} layers x {plan.num_experts} experts but model {mcfg.name!r} has "
            f"{mcfg.num_layers} x {mcfg.num_experts}; make the plan with --model {mcfg.name}"
        )
    if cfg.use_distributed_optimizer:
        raise ValueError("use_distributed_optimizer is not supported by HeterMoE yet (each side steps Megatron's "
                         "Adam on an exact global norm); set it False")
    schedule = run.schedule or plan.schedule
    from megatron_hetermoe.plan.validation import check_issuer, check_pool_precision

    check_issuer(zebra_config.issuer, cfg.emulate is not None)
    check_pool_precision(cfg, plan, run)
    pools = run.pools(cfg)
    emulator = None
    if cfg.emulate is not None:
        from megatron_hetermoe.emulation.emulator import Emulator

        emulator = Emulator(cfg.emulate)
        emulator.check_real_model(mcfg)
        emulator.check_plan(plan)
    n_attn = len(plan.attention_ranks)
    nmb = cfg.num_microbatches(n_attn)
    if nmb != plan.num_microbatches:
        raise PlanError(
            f"global batch {cfg.global_batch_size} = micro batch {cfg.micro_batch_size} x {nmb} microbatches x "
            f"{n_attn} attention ranks, but the plan has R={plan.num_microbatches}; set --global-batch-size "
            f"{cfg.micro_batch_size * plan.num_microbatches * n_attn} or remake the plan with R={nmb}"
        )
    collective_trace.install()  # $HETERMOE_TRACE_COLLECTIVES: every collective's order, to check
    hs = initialize_hetero_parallel(plan, device=rank_device(), wire_dtype=precision_dtype(pools.wire))
    precision = pools.of(hs.role)  # this rank's pool's
    if pools.mixed and hs.rank == 0 and not cfg.quiet:
        scale = "dynamic" if pools.dynamic_scale(cfg.loss_scale) else f"constant {cfg.loss_scale}"
        print(f" precision: attention ranks {pools.attention}, expert ranks {pools.expert}, tokens cross in "
              f"{pools.wire}, one {scale} loss scale", flush=True)
    if precision == "bf16":
        check_native_bf16(hs.device)
    with megatron_globals(hs, cfg.seed):
        torch.manual_seed(cfg.seed)
        pgc = hs.pg_collection()
        # ep>1 only marks expert weights allreduce=False, so DDP reduces them over the
        # expert replica group instead of the attention DP group.
        # The pool's precision; tokens cross in hs.wire_dtype (TokenRoute casts at the boundary).
        kernels = choose_kernels(hs.device, precision, cfg.transformer_impl, cfg.moe_grouped_gemm)
        config = transformer_config(mcfg, ParallelConfig(), precision, kernels=kernels.name,
                                    expert_model_parallel_size=2, deterministic_mode=cfg.deterministic)
        base = layer_spec(mcfg, kernels.name)
        if hs.role == "attention":
            module = build_gpt(mcfg, config, spec=hetero_layer_spec(base, hs, pgc), pg_collection=pgc)
            names = canonical_names(module)
        else:
            module = ExpertRuntime(config, base.submodules.mlp.submodules.experts, hs)
            names = module.canonical_names()
        if cfg.init_state is not None:
            load_params(module, megatron_to_hetero(cfg.init_state, plan, hs.rank))
        else:
            init_layout_invariant(module, cfg.seed, config, names)
        module.to(hs.device)  # built and initialized on the CPU (use_cpu_initialization)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        # bf16/fp16: Float16Module on both roles (the expert ranks' ExpertRuntime too), as
        # Megatron-LM's get_model wraps a chunk before DDP.
        model = DistributedDataParallel(config, ddp_config, wrap_precision(config, module), pg_collection=pgc)
        guard = NanGuard(cfg.nan_check_mode(pools), [model],
                         {p: names[n] for n, p in module.named_parameters()}, hs.rank, hs.role,
                         hs.world_group, cfg.nan_injection, device=hs.device)
        # clip_grad=0: clipped by HeteroStep on the global norm of both sides.
        optimizer, scheduler = build_optimizer(cfg, model, 0.0, False, pg_collection=pgc, precision=precision,
                                               dynamic_scale=pools.dynamic_scale(cfg.loss_scale))
        # Attention ranks scale the loss (grad_scale_func); expert ranks get gradients already
        # scaled by it, so every rank's scaler must hold the same scale and skip the same steps.
        share_loss_scale(optimizer, hs.world_group, hs.device)
        if hs.role == "attention":
            config.finalize_model_grads_func = lambda m, n=None, pg_collection=None, force_all_reduce=False: \
                finalize_model_grads(m, n, pg_collection=pgc, force_all_reduce=force_all_reduce)
            config.grad_scale_func = optimizer.scale_loss
            config.no_sync_func = model.no_sync
        # Every step's events only for a timeline to write; else the current step's (utilization).
        recorder = TimelineRecorder(hs.rank, hs.role, keep_history=run.timeline_dir is not None)
        steplog = StepLogger(cfg, hs.role, recorder, hs.world_group, dist.get_rank() == 0)
        executed: collections.deque = collections.deque(maxlen=1)  # the last step's order and activation peak
        clock = None
        if emulator is not None:
            clock = emulator.hetero_clock(plan, schedule, hs.world_group, zebra_config.recompute)
            zebra_config = emulator.zebra_config(plan, hs.rank, schedule, recompute=zebra_config.recompute,
                                                 clock=clock)
        # Emulated DistEP runs its task list, so both schedules are timed by one executor.
        task_list = emulator is not None
        extra = {} if (hs.role == "attention" and schedule == "distep" and not task_list) else \
            {"zebra_config": zebra_config, "recorder": recorder, "executed": executed}
        fwd_bwd = get_forward_backward_func(hs, schedule, task_list=task_list, **extra)
        role = HeteroStep(cfg, hs, model, module, fwd_bwd, nmb, optimizer)
        parts = LoopParts(cfg, model, optimizer, scheduler, guard, recorder, steplog,
                          hetero_checkpointer(cfg, hs, module, names, optimizer, scheduler, pools.expert),
                          hs.world_group, clock)
        reset_peak_memory(hs.device)  # the GPU peak counts from here (model and optimizer already allocated)
        res = train_loop(parts, role)
        gpu = peak_gpu_mib(hs.role, hs.device, hs.world_group)  # before the exports below; None on CPU ranks
        emulation = clock.report() if clock is not None else None
        params = export_megatron(hs, model, "data") if cfg.collect_grads else None
        if run.timeline_dir is not None:
            recorder.save(run.timeline_dir)
        peak = [None] * dist.get_world_size()
        dist.all_gather_object(peak, (hs.role, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                               group=hs.world_group)
        out = {"losses": res.losses, "grads": role.grads, "params": params, "step_times": res.step_times,
               "start_iteration": res.start_iteration, "num_microbatches": nmb, "dp": n_attn,
               "schedule": schedule, "skipped": guard.skipped, "loss_scales": res.loss_scales,
               "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
               "overflow_skipped": res.overflow_skipped,
               "executed": [(list(a), {k: list(v) for k, v in b.items()}) for a, b, _ in executed],
               "peak_activation_mib": max((m for _, _, m in executed), default=0) / 2**20,
               "peak_rss_mib": peak,
               "busy_s": last_step_busy(recorder, cfg.train_iters - 1, hs.world_group),
               "emulation": emulation, "kernels": kernels.name, "kernels_reason": kernels.reason}
        if gpu is not None:  # CUDA ranks only: absent, not zeros, on CPU
            out["peak_gpu_mib"] = gpu
        return out


_UNWRAP = re.compile(r"^(?:module\.)+")  # DDP's and Float16Module's prefixes


def export_megatron(hs: HeteroParallelState, model, attr: str = "data", scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Every rank's parameters (or main_grad) merged into a plain Megatron state dict, on all
    ranks (plan.layout.hetero_to_megatron over an all_gather)."""
    # CPU copies: a pickled CUDA tensor would unpickle onto the sender's GPU.
    local = {_UNWRAP.sub("", n): (getattr(p, attr).detach().clone().float() * scale).cpu()
             for n, p in model.named_parameters()}
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, local, group=hs.world_group)
    return hetero_to_megatron(world, hs.plan)
