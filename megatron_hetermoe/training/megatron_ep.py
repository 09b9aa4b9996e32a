"""The Megatron EP trainer: plain Megatron-Core MoE training (TP/PP/EP/DP).

This is the reference every HeterMoE feature is proven against: Megatron's own GPTModel,
schedules (1F1B when PP>1), DDP and optimizer, with deterministic data and layout-invariant
initial weights. `train(cfg)` runs on an initialized process group (training/args.py starts
ranks); the loop is training/loop.py's, shared with the HeterMoE trainer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hetermoe.checkpoint.hooks import megatron_checkpointer
from megatron_hetermoe.config import MEGATRON_ROLE, TrainConfig
from megatron_hetermoe.data.dataset import make_data
from megatron_hetermoe.models.builder import (
    build_gpt,
    canonical_names,
    choose_fusions,
    choose_kernels,
    gather_rank_envs,
    init_layout_invariant,
    router_expert_bias,
    transformer_config,
    wrap_precision,
    wrapped_names,
)
from megatron_hetermoe.parallel.device import (
    check_native_bf16,
    group_timeout,
    peak_gpu_mib,
    rank_device,
    reset_peak_memory,
    set_deterministic,
)
from megatron_hetermoe.plan.expert_names import module_state
from megatron_hetermoe.plan.layout import load_params
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.training.logging import StepLogger, last_step_busy
from megatron_hetermoe.training.loop import LoopParts, train_loop
from megatron_hetermoe.training.nan_check import NanGuard
from megatron_hetermoe.training.result import TrainResult
from megatron_hetermoe.training.run_hooks import RunHooks
from megatron_hetermoe.training.step import (
    batch_to,
    build_optimizer,
    forward_step,
    gather_canonical,
    loss_scale_of,
    share_loss_scale,
)


class MegatronEPStep:
    """A Megatron EP rank's part of the loop: Megatron's forward_backward_func over its
    microbatches; Megatron's optimizer clips and reports the norm."""

    def __init__(self, cfg: TrainConfig, hooks: RunHooks, model, module, names: dict[str, str], nmb: int,
                 data_parallel_rank: int, device: torch.device, optimizer, tp_group=None):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.cfg, self.hooks, self.model, self.module, self.names, self.nmb = cfg, hooks, model, module, names, nmb
        self.dp_rank, self.device, self.optimizer = data_parallel_rank, device, optimizer
        self.last_stage = ps.is_pipeline_last_stage()
        self.fwd_bwd = get_forward_backward_func()
        self.model_names = wrapped_names(model, names)
        # Megatron's TP group when TP > 1: canonical state in and out is cut to / merged from shards.
        self.tp_group = tp_group
        self.data = make_data(cfg)
        self.step_params: list[dict] = []
        self.grads: list[dict] = []

    def before_step(self, it: int) -> None:
        if self.hooks.pin_params is not None:
            load_canonical(self.module, self.names, self.hooks.pin_params[it], self.tp_group)
        if self.hooks.collect_grads:
            self.step_params.append(gather_canonical([self.model], [self.model_names], "data",
                                                     tp_group=self.tp_group))

    def forward_backward(self, it: int):
        cfg, nmb = self.cfg, self.nmb
        batches = iter([batch_to(self.data.microbatch(it, self.dp_rank * nmb + m, cfg.micro_batch_size,
                                                      cfg.global_batch_size), self.device)
                        for m in range(nmb)])
        reduced = self.fwd_bwd(
            forward_step_func=forward_step, data_iterator=batches, model=[self.model],
            num_microbatches=nmb, seq_length=cfg.model.seq_length, micro_batch_size=cfg.micro_batch_size,
            forward_only=False,
        )
        self.reduced = reduced
        return [r["lm loss"] for r in reduced]

    def local_loss(self):
        tot = torch.zeros(2, device=self.device)
        if self.last_stage:  # the loss is known on the last pipeline stage only
            for r in self.reduced:
                tot += r["lm loss"]
        return tot

    def before_optimizer(self):
        if self.hooks.collect_grads:  # unscaled, as Megatron's optimizer reads them
            self.grads.append(gather_canonical([self.model], [self.model_names], "main_grad",
                                               1.0 / loss_scale_of(self.optimizer), tp_group=self.tp_group))
        return None


def train(cfg: TrainConfig, hooks: RunHooks | None = None) -> TrainResult:
    """Train on the current process group with Megatron's parallel state; returns per-step
    losses (and canonical grads with hooks.collect_grads) on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetermoe.training.validation import check_megatron_tp

    hooks = hooks or RunHooks()
    par = cfg.parallel
    check_megatron_tp(cfg)  # library callers skip validate_job
    world = dist.get_world_size()
    if world % (par.tp * par.pp):
        raise ValueError(f"world size {world} is not divisible by TP {par.tp} x PP {par.pp}")
    device = rank_device()
    if cfg.bf16:
        check_native_bf16(device)
    if cfg.deterministic:
        set_deterministic(device)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=max(1, int(group_timeout().total_seconds() // 60)),
    )
    emu_undo = None
    try:
        model_parallel_cuda_manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        dp = ps.get_data_parallel_world_size()
        nmb = cfg.num_microbatches(dp)
        mcfg = cfg.model
        # Every rank shares a gradient reduction with every other (DP, EP and their buckets): the
        # world is one pool (choose_kernels), its oldest GPU decides; fusions are each rank's.
        envs = gather_rank_envs(device)
        kernels = choose_kernels(device, cfg.precision, cfg.transformer_impl, cfg.moe_grouped_gemm, envs)
        fusions = choose_fusions(envs[dist.get_rank()], kernels.name, MEGATRON_ROLE)
        config = transformer_config(mcfg, par, cfg.precision, kernels=kernels.name, fusions=fusions,
                                    deterministic_mode=cfg.deterministic)
        module = build_gpt(mcfg, config, pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage(), device=device)
        names = canonical_names(module)
        tp_group = ps.get_tensor_model_parallel_group() if par.tp > 1 else None
        if hooks.init_state is not None:
            load_canonical(module, names, hooks.init_state, tp_group)
        else:
            init_layout_invariant(module, cfg.seed, config, names, tp_group=tp_group)
        module.to(device)  # built and initialized on the CPU (use_cpu_initialization)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        model = DistributedDataParallel(config, ddp_config, wrap_precision(config, module))
        guard = NanGuard(cfg.nan_check_mode(), [model], {p: names[n] for n, p in module.named_parameters()},
                         dist.get_rank(), MEGATRON_ROLE, injection=hooks.nan_injection, device=device)
        optimizer, scheduler, _ = build_optimizer(cfg, model, cfg.clip_grad, cfg.use_distributed_optimizer)
        # One loss scale for the world, as HeterMoE has it (step.py: Megatron's dense and expert
        # scalers would back off apart when only expert gradients overflow).
        share_loss_scale(optimizer, dist.group.WORLD, device)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = model.no_sync
        recorder = TimelineRecorder(dist.get_rank(), MEGATRON_ROLE, keep_history=False)  # writes no timeline
        steplog = StepLogger(cfg, MEGATRON_ROLE, recorder, dist.group.WORLD, dist.get_rank() == 0)
        clock = None
        if cfg.emulate is not None:
            emu_undo, clock = _install_ep_emulation(cfg, module, nmb, recorder)
        role = MegatronEPStep(cfg, hooks, model, module, names, nmb, ps.get_data_parallel_rank(), device, optimizer,
                              tp_group)
        parts = LoopParts(cfg, model, optimizer, scheduler, guard, recorder, steplog,
                          megatron_checkpointer(cfg, module, names, optimizer, scheduler), dist.group.WORLD, clock)
        reset_peak_memory(device)  # the GPU peak counts from here (model and optimizer already allocated)
        res = train_loop(parts, role)
        gpu = peak_gpu_mib(MEGATRON_ROLE, device, dist.group.WORLD)  # before the exports below; None on CPU ranks
        emulation = clock.report() if clock is not None else None
        params = (gather_canonical([model], [role.model_names], "data", tp_group=tp_group)
                  if hooks.collect_grads else None)
        return TrainResult(
            losses=res.losses, step_times=res.step_times, start_iteration=res.start_iteration, num_microbatches=nmb,
            dp=dp, skipped=guard.skipped, loss_scales=res.loss_scales, overflow_skipped=res.overflow_skipped,
            param_dtypes=sorted({str(p.dtype) for p in module.parameters()}), kernels=kernels.name,
            kernels_reason=kernels.reason, busy_s=last_step_busy(recorder, cfg.train_iters - 1, dist.group.WORLD),
            emulation=emulation, peak_gpu_mib=gpu, params=params, grads=role.grads, step_params=role.step_params,
            initial_params=role.step_params[0] if role.step_params else params, grad_norms=res.grad_norms,
            router_expert_bias=router_expert_bias(module, names))
    finally:
        if emu_undo is not None:
            emu_undo()
        ps.destroy_model_parallel()


def load_canonical(module, names: dict[str, str], state: dict, tp_group=None) -> None:
    """Load a canonical state (plain Megatron TP=1 names and shapes) into this rank's module,
    each TP-split parameter cut to this rank's shard (models/tp_shards.py) under TP."""
    from megatron_hetermoe.models.tp_shards import shard_local_state

    local = module_state(names, state)
    if tp_group is not None:
        local = shard_local_state(module, local, tp_group, glu=bool(module.config.gated_linear_unit))
    load_params(module, local)


def _install_ep_emulation(cfg: TrainConfig, module, nmb: int, recorder):
    """Time this plain Megatron EP rank as its emulated GPU: the prediction fixes the EP size and
    microbatch count the run must use; returns (undo, the rank's emulation clock)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_hetermoe.emulation.emulator import Emulator
    from megatron_hetermoe.emulation.megatron_ep import ep_sync_groups, install_ep_hooks

    em = Emulator(cfg.emulate)
    em.check_real_model(cfg.model)
    W = em.cluster.world_size
    ranks = list(cfg.emulate.ranks) if cfg.emulate.ranks else list(range(W))
    if len(ranks) != dist.get_world_size():
        raise ValueError(f"emulating cluster ranks {ranks} needs {len(ranks)} processes, got {dist.get_world_size()}")
    pred = em.predict_ep(ranks if len(ranks) != W else None)
    if not pred.fits:
        raise ValueError(f"Megatron EP does not fit on the emulated cluster: {pred.reason}")
    d, r_mb = pred.detail["ep_size"], pred.detail["microbatches"]
    if ps.get_expert_model_parallel_world_size() != d or nmb != r_mb:
        raise ValueError(
            f"the emulated EP run is EP={d} with {r_mb} microbatches per step (what fits in memory), but this "
            f"run has EP={ps.get_expert_model_parallel_world_size()} and {nmb}; set --expert-model-parallel-size "
            f"{d} and --global-batch-size {r_mb * dist.get_world_size() * cfg.micro_batch_size}")
    procs = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    clock = em.ep_clock(pred, dist.group.WORLD)
    undo = install_ep_hooks(em, module, ranks[dist.get_rank()], [ranks[r] for r in procs],
                               pred.detail["tokens_per_microbatch"], recorder, clock, ep_sync_groups(procs))
    return undo, clock
