"""Baseline trainer: plain Megatron-Core MoE training (TP/PP/EP/DP) on CPU ranks or GPUs.

This is the reference every HeterMoE feature is proven against: Megatron's own GPTModel,
schedules (1F1B when PP>1), DDP and optimizer, with deterministic data and layout-invariant
initial weights. `train(cfg)` runs on an initialized process group; `main(argv)` parses
Megatron-style flags and starts CPU ranks with the launcher (or joins a torchrun job).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch

from megatron_hetermoe.config import ModelConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.data.dataset import (
    add_data_args,
    data_config_from_args,
    make_data,
)
from megatron_hetermoe.models.builder import (
    build_gpt,
    canonical_names,
    init_layout_invariant,
    transformer_config,
)
from megatron_hetermoe.plan.layout import load_params
from megatron_hetermoe.reliability.nan_check import NanGuard
from megatron_hetermoe.tools.timeline import TimelineRecorder
from megatron_hetermoe.training.logging import StepLogger


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's GPT loss: token-summed loss and token count, reported as 'lm loss'."""
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, partial(loss_func, batch["loss_mask"])


def gather_canonical(model_chunks, names_per_chunk, attr: str) -> dict[str, torch.Tensor]:
    """{canonical name: tensor} of params (attr='data') or grads (attr='main_grad') from every
    rank, merged on all ranks. Replicas hold equal values, so the first copy is kept."""
    import torch.distributed as dist

    local = {}
    for chunk, names in zip(model_chunks, names_per_chunk):
        for n, p in chunk.named_parameters():
            t = getattr(p, attr, None)
            if t is None and attr == "main_grad":
                t = p.grad
            local[names[n]] = (t.detach().clone().float() if t is not None else torch.zeros_like(p, dtype=torch.float))
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, local)
    merged: dict[str, torch.Tensor] = {}
    for d in world:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def train(cfg: TrainConfig) -> dict:
    """Train on the current process group with Megatron's parallel state; return per-step
    losses (and canonical grads when cfg.collect_grads) on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetermoe.parallel.launcher import collective_timeout

    par = cfg.parallel
    world = dist.get_world_size()
    if world % (par.tp * par.pp):
        raise ValueError(f"world size {world} is not divisible by TP {par.tp} x PP {par.pp}")
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        distributed_timeout_minutes=max(1, int(collective_timeout().total_seconds() // 60)),
    )
    emu_undo = None
    try:
        model_parallel_cuda_manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        dp = ps.get_data_parallel_world_size()
        nmb = cfg.num_microbatches(dp)
        mcfg = cfg.model
        config = transformer_config(mcfg, par, deterministic_mode=cfg.deterministic)
        module = build_gpt(mcfg, config, pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage())
        names = canonical_names(module)
        if cfg.init_state is not None:
            load_params(module, {local: cfg.init_state[canon] for local, canon in names.items()})
        else:
            init_layout_invariant(module, cfg.seed, mcfg.num_layers, names)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        model = DistributedDataParallel(config, ddp_config, module)
        guard = NanGuard(cfg.check_for_nan_in_loss_and_grad, [model], {p: names[n] for n, p in module.named_parameters()},
                         dist.get_rank(), "ep", injection=cfg.nan_injection)
        model_names = {f"module.{k}": v for k, v in names.items()}
        optimizer, scheduler = build_optimizer(cfg, model, cfg.clip_grad, cfg.use_distributed_optimizer)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = model.no_sync
        recorder = TimelineRecorder(dist.get_rank(), "ep")
        steplog = StepLogger(cfg, "ep", recorder, dist.group.WORLD, dist.get_rank() == 0)
        clock = None
        if cfg.emulate is not None:
            emu_undo, clock = _install_ep_emulation(cfg, module, nmb, recorder)

        data = make_data(cfg)
        dp_rank = ps.get_data_parallel_rank()
        fwd_bwd = get_forward_backward_func()
        losses, grads, step_times, step_params = [], [], [], []
        from megatron_hetermoe.checkpoint.store import megatron_checkpointer

        ckpt = megatron_checkpointer(cfg, module, names, optimizer, scheduler)
        start = ckpt.resume()
        for it in range(start, cfg.train_iters):
            guard.start(it)  # a resumed run starts past 0
            if cfg.pin_params is not None:
                load_params(module, {local: cfg.pin_params[it][canon] for local, canon in names.items()})
            if cfg.collect_grads:
                step_params.append(gather_canonical([model], [model_names], "data"))
            t0 = time.perf_counter()
            if clock is not None:
                clock.step_begin(it, t0)
            recorder.step = it
            batches = iter([data.microbatch(it, dp_rank * nmb + m, cfg.micro_batch_size, cfg.global_batch_size)
                            for m in range(nmb)])
            model.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = fwd_bwd(
                forward_step_func=forward_step, data_iterator=batches, model=[model],
                num_microbatches=nmb, seq_length=mcfg.seq_length, micro_batch_size=cfg.micro_batch_size,
                forward_only=False,
            )
            skip = guard.after_backward(it, [r["lm loss"] for r in reduced])
            if cfg.collect_grads:
                grads.append(gather_canonical([model], [model_names], "main_grad"))
            lr_used = optimizer.param_groups[0]["lr"]
            if skip:  # Megatron's skipped iteration: no update, no LR step
                grad_norm = None
            else:
                ok, grad_norm, _ = optimizer.step()
                scheduler.step(increment=1)
            if clock is not None:  # gradient all-reduce + optimizer on the emulated GPUs
                clock.post_step()
            # lm loss: token-weighted over microbatches and DP ranks, known on the last stage.
            tot = torch.zeros(2)
            if ps.is_pipeline_last_stage():
                for r in reduced:
                    tot += r["lm loss"]
            dist.all_reduce(tot)  # last-stage ranks are the only non-zero ones
            loss = (tot[0] / tot[1]).item()
            losses.append(loss)
            step_times.append(time.perf_counter() - t0)
            if clock is not None:
                clock.step_end(it, step_times[-1])
            steplog.log(it + 1, step_times[-1], lr_used, loss, grad_norm)
            ckpt.after_step(it + 1)
        ckpt.finish(max(start, cfg.train_iters))
        emulation = clock.report() if clock is not None else None
        params = gather_canonical([model], [model_names], "data") if cfg.collect_grads else None
        return {"losses": losses, "grads": grads, "params": params, "step_params": step_params,
                "initial_params": step_params[0] if step_params else params, "start_iteration": start,
                "step_times": step_times, "num_microbatches": nmb, "dp": dp, "skipped": guard.skipped,
                "busy_s": last_step_busy(recorder, cfg.train_iters - 1, dist.group.WORLD), "emulation": emulation}
    finally:
        if emu_undo is not None:
            emu_undo()
        ps.destroy_model_parallel()


def last_step_busy(recorder, step: int, group) -> list[float]:
    """Seconds each rank spent in (emulated) compute during `step`, from its timeline."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, recorder.busy(step), group=group)
    return out


def _install_ep_emulation(cfg: TrainConfig, module, nmb: int, recorder):
    """Time this plain Megatron EP rank as its emulated GPU: the prediction fixes the EP size and
    microbatch count the run must use; returns (undo, the rank's emulation clock)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_hetermoe.emulation.emulator import Emulator, ep_sync_groups

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
    undo = em.install_ep_hooks(module, ranks[dist.get_rank()], [ranks[r] for r in procs],
                               pred.detail["tokens_per_microbatch"], recorder, clock, ep_sync_groups(procs))
    return undo, clock


def build_optimizer(cfg: TrainConfig, model, clip_grad: float, use_distributed_optimizer: bool,
                    pg_collection=None):
    """Megatron's Adam and its cosine LR schedule, as both trainers use them."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, clip_grad=clip_grad, bf16=False, fp16=False,
        params_dtype=torch.float32, use_distributed_optimizer=use_distributed_optimizer,
    )
    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=False, **kw)
    steps = max(cfg.train_iters, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters, lr_decay_steps=steps, lr_decay_style="cosine",
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
    )
    return optimizer, scheduler


def format_iteration(it: int, cfg: TrainConfig, dt: float, lr, loss: float, grad_norm) -> str:
    """A Megatron-style iteration line."""
    tokens = cfg.global_batch_size * cfg.model.seq_length
    gn = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
    bar = ""
    if cfg.progress_bar:
        done = round(20 * it / cfg.train_iters)
        bar = f"[{'#' * done}{'.' * (20 - done)}] "
    return (bar + f" iteration {it:>8}/{cfg.train_iters:>8} | consumed samples: {it * cfg.global_batch_size:>10} | "
            f"elapsed time per iteration (ms): {dt * 1000:.1f} | tokens/s: {tokens / dt:.0f} | "
            f"learning rate: {lr:.6E} | global batch size: {cfg.global_batch_size:>5} | "
            f"lm loss: {loss:.6E} | grad norm: {gn} |")


# ---- command line ------------------------------------------------------------------------
def add_megatron_args(p: argparse.ArgumentParser) -> None:
    """The subset of Megatron-LM pretrain_gpt.py flags the baseline trainer takes."""
    p.add_argument("--model", default="tiny", help="model config: a name in the config directory's models/ "
                   "(hetermoe --config-dir) or a path to a YAML file")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (only 1 is supported yet)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP size (1F1B); must divide the model's layers")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP size; must divide the model's experts and the world size / PP")
    p.add_argument("--moe-token-dispatcher-type", default="alltoall", choices=["alltoall", "allgather"],
                   help="Megatron's MoE token dispatcher (flex needs DeepEP on GPUs)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per microbatch per rank")
    p.add_argument("--global-batch-size", type=int, default=8,
                   help="sequences per step; a multiple of --micro-batch-size x data-parallel size")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the model config's)")
    p.add_argument("--train-iters", type=int, default=5, help="optimizer steps to train (the LR schedule's length)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (Adam; cosine decay to --min-lr)")
    p.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at the end of the cosine decay")
    p.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="linear warm-up steps from 0 to --lr; fewer than --train-iters")
    p.add_argument("--weight-decay", type=float, default=0.01, help="Adam weight decay")
    p.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--seed", type=int, default=1234, help="seed of weights and data order, in [0, 2^32)")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (Megatron's); not with --hetero-plan")
    p.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise reproducible runs (deterministic kernels; regress compares exactly)")
    p.add_argument("--log-interval", type=int, default=1, help="print an iteration line every this many steps")
    p.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here (first rank; default: none)")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="load-balancing loss weight (default: the model config's)")
    add_data_args(p)
    p.add_argument("--save", default=None, help="directory to save checkpoints to (default: no checkpoints)")
    p.add_argument("--load", default=None, help="directory to load a checkpoint from (latest_checkpointed_iteration.txt; "
                   "default: start from scratch)")
    p.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoint saves (default: only at the end)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration (default: the latest)")
    p.add_argument("--hetero-ckpt-reshard", action="store_true",
                   help="load a checkpoint saved under another layout/plan by parameter name (RNG not restored)")
    p.add_argument("--check-for-nan-in-loss-and-grad", nargs="?", const="stop", default="stop",
                   choices=["stop", "skip"],
                   help="on a non-finite loss or gradient: stop the run (Megatron's meaning, the default) "
                        "or skip the step on every rank")
    p.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_const", const="off",
                   help="do not check (default: check, see --check-for-nan-in-loss-and-grad)")
    g = p.add_argument_group("emulation of a mixed cluster on CPU ranks (HeterMoE's own flags)")
    g.add_argument("--emulate", default=None, metavar="CLUSTER",
                   help="time every rank as the GPU of its position in this cluster (a clusters/ name or a "
                        "path; default: no emulation)")
    g.add_argument("--emulated-model", default=None, help="model shape whose cost is emulated (default: --model)")
    g.add_argument("--emulated-seq-length", type=int, default=None, help="its sequence length (default: 4096)")
    g.add_argument("--emulated-global-batch-size", type=int, default=None,
                   help="its sequences per step (default: 4 per emulated GPU)")
    g.add_argument("--emulation-scale", default="1.0",
                   help="real seconds per emulated second, or 'auto': picked from a calibration step (the "
                        "second) so that the real work fits inside the emulated times")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    model = ModelConfig.load(a.model)
    over = {}
    if a.seq_length is not None:
        over["seq_length"] = a.seq_length
    if a.moe_aux_loss_coeff is not None:
        over["moe_aux_loss_coeff"] = a.moe_aux_loss_coeff
    if over:
        model = model.replace(**over)
    return TrainConfig(
        model=model,
        parallel=ParallelConfig(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                a.expert_model_parallel_size, a.moe_token_dispatcher_type),
        micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
        train_iters=a.train_iters, lr=a.lr, min_lr=a.min_lr, lr_warmup_iters=a.lr_warmup_iters,
        weight_decay=a.weight_decay, clip_grad=a.clip_grad, seed=a.seed,
        use_distributed_optimizer=a.use_distributed_optimizer, deterministic=a.deterministic_mode,
        log_interval=a.log_interval, tensorboard_dir=a.tensorboard_dir, check_for_nan_in_loss_and_grad=a.check_for_nan_in_loss_and_grad,
        save=a.save, load=a.load, save_interval=a.save_interval, ckpt_step=a.ckpt_step,
        ckpt_reshard=a.hetero_ckpt_reshard, emulate=emulation_from_args(a),
        data=data_config_from_args(a, model),
    )


def emulation_from_args(a: argparse.Namespace):
    if not a.emulate:
        for flag in ("emulated_model", "emulated_seq_length", "emulated_global_batch_size"):
            if getattr(a, flag) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')} needs --emulate CLUSTER")
        return None
    from megatron_hetermoe.emulation.emulator import EmulationSpec
    from megatron_hetermoe.planner.cluster import Cluster

    gb = a.emulated_global_batch_size or 4 * Cluster.load(a.emulate).world_size
    auto = str(a.emulation_scale) == "auto"
    try:
        scale = 1.0 if auto else float(a.emulation_scale)
    except ValueError:
        raise SystemExit(f"--emulation-scale {a.emulation_scale!r}: give a number of real seconds per emulated "
                         f"second, or auto") from None
    return EmulationSpec(a.emulate, a.emulated_model or a.model, a.emulated_seq_length or 4096, gb,
                         scale=scale, auto_scale=auto)


def _rank_main(rank: int, world: int, cfg: TrainConfig, plan=None, hetero: dict | None = None) -> dict:
    if plan is None:
        return train(cfg)
    from megatron_hetermoe.config import ZebraConfig
    from megatron_hetermoe.training.hetero import train_hetero

    h = hetero or {}
    return train_hetero(cfg, plan, schedule=h.get("schedule"), run_dir=h.get("run_dir"),
                        zebra_config=ZebraConfig(recompute=h.get("recompute", False)))


def run(cfg: TrainConfig, nproc: int, timeout_s: float = 900.0, plan=None, hetero: dict | None = None) -> dict:
    """Train on `nproc` forked CPU ranks (plain Megatron, or HeterMoE with a plan); return
    rank 0's result."""
    from megatron_hetermoe.parallel.launcher import launch

    return launch(_rank_main, nproc, cfg, plan, hetero, timeout_s=timeout_s)[0]


def build_parser(prog: str = "hetermoe train") -> argparse.ArgumentParser:
    """`hetermoe train`'s flags; pretrain_gpt.py adds Megatron's model-shape flags to these."""
    from megatron_hetermoe.cli import HelpFormatter

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_megatron_args(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="CPU ranks to start (default: join a torchrun job if RANK is set, else 4)")
    p.add_argument("--golden-values-out", default=None, help="write per-step lm loss as Megatron golden values JSON (default: none)")
    p.add_argument("--hetero-plan", default=None, help="train with HeterMoE on this plan (hetermoe plan -o plan.json; default: plain Megatron)")
    p.add_argument("--hetero-schedule", choices=["distep", "zebra"], default=None,
                   help="HeterMoE schedule (default: the plan's)")
    p.add_argument("--recompute-granularity", choices=["full"], default=None,
                   help="zebra: recompute attention stages in backward (Megatron's 'full' meaning, per stage; "
                        "default: keep activations)")
    p.add_argument("--timeline-dir", default=None, help="HeterMoE: write each rank's timeline here (default: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    return run_from_args(p, p.parse_args(argv))


def run_from_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Validate, launch (forked CPU ranks or the surrounding torchrun job) and report a run."""
    try:
        cfg = config_from_args(a)
    except (ValueError, FileNotFoundError) as e:  # a bad model config, --seq-length, parallel size
        p.error(str(e))
    hetero = {"schedule": a.hetero_schedule, "recompute": a.recompute_granularity == "full",
              "run_dir": a.timeline_dir}
    if not a.hetero_plan and (a.hetero_schedule or a.timeline_dir):
        raise SystemExit("--hetero-schedule and --timeline-dir need --hetero-plan")
    if a.hetero_plan:
        from megatron_hetermoe.plan.hetero_plan import HeteroPlan

        try:
            plan = HeteroPlan.load(a.hetero_plan)
        except (ValueError, OSError) as e:
            p.error(f"--hetero-plan: {e}")
        if cfg.parallel != ParallelConfig(dispatcher=cfg.parallel.dispatcher):
            raise SystemExit("--hetero-plan replaces TP/PP/EP: leave the model-parallel sizes at 1")
        if a.nproc not in (None, plan.world_size):
            raise SystemExit(f"--nproc {a.nproc} but the plan has {plan.world_size} ranks; drop --nproc")
        if "RANK" not in os.environ:  # under torchrun, join its ranks instead of forking more
            a.nproc = plan.world_size
    joining = "RANK" in os.environ and a.nproc is None
    try:  # every input, before any process group (torchrun's or ours) exists
        from megatron_hetermoe.plan.validation import validate_job

        validate_job(cfg, int(os.environ.get("WORLD_SIZE", 0)) if joining else (a.nproc or 4),
                     plan if a.hetero_plan else None, a.hetero_schedule)
    except ValueError as e:
        p.error(str(e))
    if joining:
        import torch.distributed as dist

        from megatron_hetermoe.parallel import cpu_backend
        from megatron_hetermoe.parallel.launcher import collective_timeout

        cpu_backend.apply()
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl", timeout=collective_timeout())
        result = _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg,
                            plan if a.hetero_plan else None, hetero)
    else:
        import megatron.core  # noqa: F401  - import once in the parent, then fork ranks

        result = run(cfg, a.nproc or 4, plan=plan if a.hetero_plan else None, hetero=hetero)
    if "peak_rss_mib" in result and int(os.environ.get("RANK", "0")) == 0:
        for r, (role, rss) in enumerate(result["peak_rss_mib"]):
            print(f" rank {r} ({role}): peak RSS {rss:.0f} MiB")
        if result.get("schedule") == "zebra":
            print(f" rank 0 peak activation memory (saved for backward): {result['peak_activation_mib']:.2f} MiB")
    if result.get("emulation") is not None and int(os.environ.get("RANK", "0")) == 0:
        from megatron_hetermoe.emulation.emulator import validity_line

        print(" " + validity_line("timing", result["emulation"]))
    if a.golden_values_out and int(os.environ.get("RANK", "0")) == 0:
        from megatron_hetermoe.tools.golden import write_golden

        write_golden(a.golden_values_out, result["losses"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
