"""HeterMoE training: attention ranks run Megatron's own schedule with HeteroMoELayer (DistEP)
or the zebra schedule; expert ranks run the mirror of either; both step their Megatron
optimizers in lockstep on one global gradient norm.

Data flows one way: plan -> process groups (hetero_parallel_state) -> model per role ->
schedule -> step. Megatron's initialize_model_parallel is never called: every megatron-core
piece gets an explicit ProcessGroupCollection, so a missed global read fails fast instead of
joining a world-wide collective the expert ranks never enter.
"""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_hetermoe.config import ParallelConfig, TrainConfig
from megatron_hetermoe.models.builder import (
    build_gpt,
    canonical_names,
    init_layout_invariant,
    layer_spec,
    transformer_config,
)
from megatron_hetermoe.parallel.state import (
    HeteroParallelState,
    destroy_hetero_parallel,
    initialize_hetero_parallel,
)
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.plan.layout import (
    hetero_to_megatron,
    load_params,
    megatron_to_hetero,
)
from megatron_hetermoe.reliability.nan_check import NanGuard
from megatron_hetermoe.tools.timeline import TimelineRecorder
from megatron_hetermoe.training.logging import StepLogger
from megatron_hetermoe.training.megatron_ep import (
    build_optimizer,
    forward_step,
    last_step_busy,
)


@contextmanager
def megatron_globals(hs: HeteroParallelState, seed: int):
    """The few megatron-core globals that have no explicit-group path: the memory buffer, the
    RNG tracker, and the tensor-parallel group read by vocab-parallel cross-entropy."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    ps._set_global_memory_buffer()
    ps._TENSOR_MODEL_PARALLEL_GROUP = hs.self_group
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    try:
        yield
    finally:
        ps._TENSOR_MODEL_PARALLEL_GROUP = None
        ps.destroy_global_memory_buffer()


def global_grad_norm(hs: HeteroParallelState, params_and_grads) -> float:
    """The exact L2 norm of the whole model's gradient: each distinct parameter counted once
    (dense ones on attention DP rank 0, experts in ZP group 0), summed over the world."""
    sq = torch.zeros(1, dtype=torch.float64)
    for p, g, is_expert in params_and_grads:
        owner = hs.group_index == 0 if is_expert else hs.attention_dp_rank == 0
        if owner:
            sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=hs.world_group)
    return float(sq.sqrt())


def _is_expert_param(p) -> bool:
    return not getattr(p, "allreduce", True)


def train_hetero(cfg: TrainConfig, plan: HeteroPlan, schedule: str | None = None,
                 zebra_config=None, run_dir: str | None = None) -> dict:
    """Train on the current world with `plan` (schedule: the plan's, or "distep"/"zebra").
    With run_dir, each rank writes its timeline there (hetermoe timeline RUN_DIR)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_hetermoe.data.dataset import make_data
    from megatron_hetermoe.models.experts import ExpertRuntime
    from megatron_hetermoe.models.moe_layer import hetero_layer_spec
    from megatron_hetermoe.schedules.select import get_forward_backward_func

    mcfg = cfg.model
    if plan.num_layers != mcfg.num_layers or plan.num_experts != mcfg.num_experts:
        raise PlanError(
            f"plan is for {plan.num_layers} layers x {plan.num_experts} experts but model {mcfg.name!r} has "
            f"{mcfg.num_layers} x {mcfg.num_experts}; make the plan with --model {mcfg.name}"
        )
    if cfg.use_distributed_optimizer:
        raise ValueError("use_distributed_optimizer is not supported by HeterMoE yet (each side steps Megatron's "
                         "Adam on an exact global norm); set it False")
    schedule = schedule or plan.schedule
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
    hs = initialize_hetero_parallel(plan)
    try:
        with megatron_globals(hs, cfg.seed):
            torch.manual_seed(cfg.seed)
            pgc = hs.pg_collection()
            # ep>1 only marks expert weights allreduce=False, so DDP reduces them over the
            # expert replica group instead of the attention DP group.
            config = transformer_config(mcfg, ParallelConfig(), expert_model_parallel_size=2,
                                        deterministic_mode=cfg.deterministic)
            base = layer_spec(mcfg)
            if hs.role == "attention":
                module = build_gpt(mcfg, config, spec=hetero_layer_spec(base, hs, pgc), pg_collection=pgc)
                names = canonical_names(module)
            else:
                module = ExpertRuntime(config, base.submodules.mlp.submodules.experts, hs)
                names = module.canonical_names()
            if cfg.init_state is not None:
                load_params(module, megatron_to_hetero(cfg.init_state, plan, hs.rank))
            else:
                init_layout_invariant(module, cfg.seed, mcfg.num_layers, names)
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       use_distributed_optimizer=False)
            model = DistributedDataParallel(config, ddp_config, module, pg_collection=pgc)
            guard = NanGuard(cfg.check_for_nan_in_loss_and_grad, [model],
                             {p: names[n] for n, p in module.named_parameters()}, hs.rank, hs.role,
                             hs.world_group, cfg.nan_injection)
            # clip_grad=0: clipped here on the global norm of both sides.
            optimizer, scheduler = build_optimizer(cfg, model, 0.0, False, pg_collection=pgc)
            if hs.role == "attention":
                config.finalize_model_grads_func = lambda m, n=None, pg_collection=None, force_all_reduce=False: \
                    finalize_model_grads(m, n, pg_collection=pgc, force_all_reduce=force_all_reduce)
                config.grad_scale_func = optimizer.scale_loss
                config.no_sync_func = model.no_sync
            data = make_data(cfg)
            recorder = TimelineRecorder(hs.rank, hs.role)
            steplog = StepLogger(cfg, hs.role, recorder, hs.world_group, dist.get_rank() == 0)
            executed: list = []
            clock = None
            if emulator is not None:
                recompute = bool(zebra_config and zebra_config.recompute)
                clock = emulator.hetero_clock(plan, schedule, hs.world_group, recompute)
                zebra_config = emulator.zebra_config(plan, hs.rank, schedule, recompute=recompute, clock=clock)
            # Emulated DistEP runs its task list, so both schedules are timed by one executor.
            task_list = emulator is not None
            extra = {} if (hs.role == "attention" and schedule == "distep" and not task_list) else \
                {"zebra_config": zebra_config, "recorder": recorder, "executed": executed}
            fwd_bwd = get_forward_backward_func(hs, schedule, task_list=task_list, **extra)
            losses, grads, step_times = [], [], []
            from megatron_hetermoe.checkpoint.store import hetero_checkpointer

            ckpt = hetero_checkpointer(cfg, hs, module, names, optimizer, scheduler)
            start = ckpt.resume()
            for it in range(start, cfg.train_iters):
                guard.start(it)  # a resumed run starts past 0
                if cfg.pin_params is not None:
                    load_params(module, megatron_to_hetero(cfg.pin_params[it], plan, hs.rank))
                t0 = time.perf_counter()
                if clock is not None:
                    clock.step_begin(it, t0)
                recorder.step = it
                model.zero_grad_buffer()
                optimizer.zero_grad()
                tot = torch.zeros(2)
                if hs.role == "attention":
                    d = hs.attention_dp_rank
                    batches = iter([data.microbatch(it, d * nmb + m, cfg.micro_batch_size, cfg.global_batch_size)
                                    for m in range(nmb)])
                    reduced = fwd_bwd(forward_step_func=forward_step, data_iterator=batches, model=[model],
                                      num_microbatches=nmb, seq_length=mcfg.seq_length,
                                      micro_batch_size=cfg.micro_batch_size, forward_only=False, pg_collection=pgc)
                    for r in reduced:
                        tot += r["lm loss"]
                else:
                    fwd_bwd(model=[model], num_microbatches=nmb)
                skip = guard.after_backward(it, [tot])  # every rank agrees over the world group
                params_and_grads = [(p, p.main_grad, _is_expert_param(p)) for p in model.parameters()]
                grad_norm = global_grad_norm(hs, params_and_grads)
                if cfg.clip_grad > 0:
                    # Megatron's rule (clip_grad_by_total_norm_fp32).
                    coeff = cfg.clip_grad / (grad_norm + 1.0e-6)
                    if coeff < 1.0:
                        for _, g, _ in params_and_grads:
                            g.mul_(coeff)
                if cfg.collect_grads:
                    # Reported before clipping, as Megatron's main_grad is before its step clips.
                    unclip = 1.0 / coeff if cfg.clip_grad > 0 and coeff < 1.0 else 1.0
                    grads.append(export_megatron(hs, model, "main_grad", scale=unclip))
                lr_used = optimizer.param_groups[0]["lr"]
                if not skip:  # Megatron's skipped iteration: no update, no LR step
                    optimizer.step()
                    scheduler.step(increment=1)
                if clock is not None:  # gradient all-reduce + optimizer on the emulated GPUs
                    clock.post_step()
                dist.all_reduce(tot, group=hs.world_group)
                loss = (tot[0] / tot[1]).item()
                losses.append(loss)
                step_times.append(time.perf_counter() - t0)
                if clock is not None:
                    clock.step_end(it, step_times[-1])
                steplog.log(it + 1, step_times[-1], lr_used, loss, grad_norm)
                ckpt.after_step(it + 1)
            ckpt.finish(max(start, cfg.train_iters))
            emulation = clock.report() if clock is not None else None
            params = export_megatron(hs, model, "data") if cfg.collect_grads else None
            if run_dir is not None:
                recorder.save(run_dir)
            peak = [None] * dist.get_world_size()
            dist.all_gather_object(peak, (hs.role, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                                   group=hs.world_group)
            return {"losses": losses, "grads": grads, "params": params, "step_times": step_times, "start_iteration": start,
                    "num_microbatches": nmb, "dp": n_attn, "schedule": schedule, "skipped": guard.skipped,
                    "executed": [(list(a), {k: list(v) for k, v in b.items()}) for a, b, _ in executed],
                    "peak_activation_mib": max((m for _, _, m in executed), default=0) / 2**20,
                    "peak_rss_mib": peak,
                    "busy_s": last_step_busy(recorder, cfg.train_iters - 1, hs.world_group),
                    "emulation": emulation}
    finally:
        destroy_hetero_parallel()


def export_megatron(hs: HeteroParallelState, model, attr: str = "data", scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Every rank's parameters (or main_grad) merged into a plain Megatron state dict, on all
    ranks (layout.hetero_to_megatron over an all_gather)."""
    local = {n.removeprefix("module."): getattr(p, attr).detach().clone().float() * scale
             for n, p in model.named_parameters()}
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, local, group=hs.world_group)
    return hetero_to_megatron(world, hs.plan)
