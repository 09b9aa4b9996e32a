"""`hetermoe train`: Megatron-LM-style flags -> TrainConfig (+ a plan), then ranks.

`hetermoe train` has two forms (training/command.py picks one): this module's main is its config form,
the model from --model (default tiny) with this trainer's defaults; the pretrain_gpt.py form
(training/pretrain_gpt.py) builds the model from Megatron-LM's flags and runs through run_from_args too.

`main(argv)` parses the flags, validates every input (and the paths the run writes, and locks
--save) before any process group exists, and starts CPU ranks with the launcher (or joins the
surrounding torchrun job); each rank runs the Megatron EP trainer (training/megatron_ep.py) or,
with --hetero-plan, the HeterMoE trainer (training/hetero.py).

A run has no wall-clock limit: it goes on while its ranks make progress (the launcher's
watchdog, --progress-timeout). Joining torchrun, a rank that fails prints its error and ends at
once (os._exit), so torchrun stops the job instead of the other ranks waiting for a collective
timeout; a clean end destroys the process group.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from megatron_hetermoe.cli import train_forms
from megatron_hetermoe.cli.train import MAX_FORKED_RANKS
from megatron_hetermoe.config import (
    HeteroRunConfig,
    LocalCheckpointConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from megatron_hetermoe.data.dataset import data_config_from_args
from megatron_hetermoe.parallel.watchdog import DEFAULT_PROGRESS_TIMEOUT_S
from megatron_hetermoe.training.hetero_args import hetero_run_config
from megatron_hetermoe.training.result import TrainResult
from megatron_hetermoe.training.run_hooks import RunHooks
from megatron_hetermoe.vocabulary import ScheduleName


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    model = ModelConfig.load(a.model)
    over = {}
    if a.seq_length is not None:
        over["seq_length"] = a.seq_length
    if a.moe_aux_loss_coeff is not None:
        over["moe_aux_loss_coeff"] = a.moe_aux_loss_coeff
    if over:
        model = model.replace(**over)
    cfg = TrainConfig(
        model=model,
        parallel=ParallelConfig(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                a.expert_model_parallel_size, a.moe_token_dispatcher_type,
                                sequence_parallel=a.sequence_parallel, cp=a.context_parallel_size,
                                cp_comm_type=tuple(a.cp_comm_type)),
        micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
        train_iters=a.train_iters, lr=a.lr, min_lr=a.min_lr, lr_warmup_iters=a.lr_warmup_iters,
        weight_decay=a.weight_decay, clip_grad=a.clip_grad, seed=a.seed,
        use_distributed_optimizer=a.use_distributed_optimizer, deterministic=a.deterministic_mode,
        log_interval=a.log_interval, tensorboard_dir=a.tensorboard_dir,
        check_for_nan_in_loss_and_grad=a.check_for_nan_in_loss_and_grad,
        save=a.save, load=a.load, save_interval=a.save_interval, ckpt_step=a.ckpt_step,
        ckpt_reshard=getattr(a, "hetero_ckpt_reshard", False),  # a parser without the --hetero-* flags
        local_ckpt=local_ckpt_from_args(a),
        emulate=emulation_from_args(a),
        data=data_config_from_args(a, model),
        bf16=a.bf16, fp16=a.fp16, loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
        min_loss_scale=a.min_loss_scale, loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
        transformer_impl=a.transformer_impl, moe_grouped_gemm=a.moe_grouped_gemm,
    )
    etp = a.tensor_model_parallel_size if a.expert_tensor_parallel_size is None else a.expert_tensor_parallel_size
    if etp != 1:  # Megatron-LM's --expert-tensor-parallel-size defaults to the TP size
        given = "" if a.expert_tensor_parallel_size is not None else \
            f" (Megatron's default: the --tensor-model-parallel-size {a.tensor_model_parallel_size})"
        raise ValueError(f"--expert-tensor-parallel-size {etp}{given}: experts split over tensor-parallel ranks are "
                         f"not built here, experts are whole; pass --expert-tensor-parallel-size 1")
    return cfg


def emulation_from_args(a: argparse.Namespace):
    if not a.emulate:
        for flag in ("emulated_model", "emulated_seq_length", "emulated_global_batch_size"):
            if getattr(a, flag) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')} needs --emulate CLUSTER")
        return None
    from megatron_hetermoe.config import EmulationSpec
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


def _rank_main(rank: int, world: int, cfg: TrainConfig, plan=None, hetero: HeteroRunConfig | None = None,
               hooks: RunHooks | None = None) -> TrainResult:
    if plan is None:
        from megatron_hetermoe.training.megatron_ep import train

        return train(cfg, hooks)
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, hetero, hooks)


def run(cfg: TrainConfig, nproc: int, timeout_s: float | None = None, plan=None,
        hetero: HeteroRunConfig | None = None, progress_timeout_s: float | None = DEFAULT_PROGRESS_TIMEOUT_S,
        hooks: RunHooks | None = None) -> TrainResult:
    """Train on `nproc` forked CPU ranks (plain Megatron, or HeterMoE with a plan); return
    rank 0's result. No wall-clock limit unless `timeout_s`: the launcher's watchdog ends a run
    whose ranks report no progress for `progress_timeout_s` (None: never). `hooks`: build-time
    objects and test seams (training/run_hooks.py)."""
    from megatron_hetermoe.parallel.launcher import launch

    return launch(_rank_main, nproc, cfg, plan, hetero, hooks, timeout_s=timeout_s,
                  progress_timeout_s=progress_timeout_s)[0]


def check_kernels(p: argparse.ArgumentParser, cfg: TrainConfig, device, pools=None) -> None:
    """--transformer-impl / --moe-grouped-gemm against what runs on this rank's `device` (its GPU's
    compute capability, what imports there) in each pool's precision (`pools`, a
    config.PoolPrecision: HeterMoE's attention and expert ranks may differ; None: the world's), a
    clear error naming the rank, its GPU and the pool for a request that cannot run, before any
    HeterMoE group exists; the first rank prints the kernels each pool would use on its own GPU.
    The trainers then choose per pool from every rank's GPU (models.builder.choose_kernels' pool
    rule), where an older GPU elsewhere in a pool may choose otherwise (printed again on CUDA)."""
    from megatron_hetermoe.models.builder import KernelError, choose_kernels, probe_rank

    rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    env = probe_rank(device, rank)
    per_pool = {"": cfg.precision} if pools is None or not pools.mixed else \
        {"attention ranks": pools.attention, "expert ranks": pools.expert}
    lines = []
    for pool, precision in per_pool.items():
        try:
            choice = choose_kernels(device, precision, cfg.transformer_impl, cfg.moe_grouped_gemm, [env])
        except KernelError as e:
            p.error(f"{pool} ({precision}): {e}" if pool else str(e))
        lines.append(f"{pool} ({precision}): {choice.line()}" if pool else choice.line())
    if int(os.environ.get("RANK", "0")) == 0:
        for line in lines:
            print(" " + line, flush=True)


def build_parser(prog: str = "hetermoe train") -> argparse.ArgumentParser:
    """`hetermoe train`'s config-form parser (cli/train.py; its help ends with the rule of the two forms,
    cli/train_forms.py), --progress-timeout defaulting to the launcher's watchdog."""
    return train_forms.config_form_parser(DEFAULT_PROGRESS_TIMEOUT_S, prog)


def main(argv: list[str] | None = None) -> int:
    """`hetermoe train`'s config form (training/command.py picks the form)."""
    p = build_parser()
    return run_from_args(p, p.parse_args(argv))


def _run_elastic(p: argparse.ArgumentParser, a: argparse.Namespace, cfg: TrainConfig, plan, hetero):
    """--elastic-restarts: training/elastic.py on forked ranks; the result holds every iteration's
    loss (a re-run iteration its last start's), and a line per restart is printed."""
    from megatron_hetermoe.training.elastic import run_elastic
    from megatron_hetermoe.training.validation import validate_job

    def start(c: TrainConfig, pl) -> "TrainResult":
        return run(c, pl.world_size, plan=pl, hetero=hetero, progress_timeout_s=a.progress_timeout or None)

    def check(c: TrainConfig, pl) -> None:
        validate_job(c, pl.world_size, pl, a.hetero_schedule, hetero)

    er = run_elastic(cfg, plan, inventory_of(p, a, plan), plan_run_of(cfg, a), a.elastic_restarts, start, check,
                     log=lambda line: print(line, flush=True))
    for rec in er.recoveries:
        took = f"{rec.recovery_s:.1f} s" if rec.recovery_s is not None else "no step completed"
        print(f" elastic restart {rec.attempt}: lost {list(rec.lost_gpus) or 'no GPU'}; {rec.plan_before} -> "
              f"{rec.plan_after}; resumed from {'the local checkpoint of ' if rec.local else ''}iteration "
              f"{rec.resumed_from}, {rec.steps_lost} step(s) run again; "
              f"failure to next completed step {took}")
    res = er.result
    first = min(er.losses, default=res.start_iteration + 1)
    res.losses = [er.losses[i] for i in sorted(er.losses)]
    res.start_iteration = first - 1
    return res


def local_ckpt_from_args(a: argparse.Namespace) -> LocalCheckpointConfig | None:
    """Megatron's non-persistent local checkpoint flags, with Megatron's checks."""
    kind, interval = a.non_persistent_ckpt_type, a.non_persistent_save_interval
    if kind in ("global", "in_memory"):
        raise ValueError(f"--non-persistent-ckpt-type {kind}: not built here; use 'local' (each rank's state in "
                         f"host memory of its node, --non-persistent-local-ckpt-dir) or persistent --save")
    if interval is not None and interval < 1:
        raise ValueError(f"--non-persistent-save-interval {interval} must be a positive number of iterations")
    if kind is None:
        if interval is not None:
            raise ValueError(f"--non-persistent-save-interval {interval} needs --non-persistent-ckpt-type local")
        if a.replication:
            raise ValueError("--replication needs --non-persistent-ckpt-type local (Megatron's rule)")
        return None
    if not a.non_persistent_local_ckpt_dir:
        raise ValueError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (a node-local "
                         "directory; a tmpfs such as /dev/shm/ckpt keeps it in host memory)")
    jump = None
    if a.replication:
        if a.replication_jump is None or a.replication_jump < 1:
            raise ValueError(f"--replication needs --replication-jump J >= 1 (got {a.replication_jump}): rank n's "
                             f"copies go to n+J, n+2J, ...; J = the GPUs per node puts them on other nodes")
        if a.replication_factor < 2:
            raise ValueError(f"--replication-factor {a.replication_factor}: give 2 or more (ranks holding each "
                             f"rank's local checkpoint, its own included)")
        jump = a.replication_jump
    elif a.replication_jump is not None:
        print("WARNING: --replication-jump was specified despite not using replication. Ignoring.", flush=True)
    return LocalCheckpointConfig(a.non_persistent_local_ckpt_dir, interval, jump, a.replication_factor)


def check_launch_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Flags about the job rather than the model: ranks, the watchdog, --ckpt-step."""
    if a.nproc is not None and not 1 <= a.nproc <= MAX_FORKED_RANKS:
        p.error(f"--nproc {a.nproc}: start 1 to {MAX_FORKED_RANKS} CPU ranks (or drop --nproc under torchrun)")
    if not a.progress_timeout >= 0:
        p.error(f"--progress-timeout {a.progress_timeout}: give seconds >= 0 (0: no progress watchdog)")
    if a.ckpt_step is not None and not a.load:
        p.error(f"--ckpt-step {a.ckpt_step} needs --load DIR: it picks the iteration to load from DIR")


def _auto_plan_at_start(a: argparse.Namespace, cfg: TrainConfig, hetero: HeteroRunConfig, device):
    """--hetero-plan auto under torchrun: the planner's pick for every rank's GPU (gathered), the
    same on every rank (the search is deterministic); checked as a given plan is. A restarted
    elastic job (torchrun --nnodes MIN:MAX --max-restarts) plans again for the world it got."""
    from megatron_hetermoe.training.elastic import gather_inventory
    from megatron_hetermoe.training.validation import validate_job

    inventory = gather_inventory(device)
    plan = _auto_plan(a, cfg, inventory)
    validate_job(cfg, inventory.size, plan, a.hetero_schedule, hetero)
    return plan


def _run_joined(cfg: TrainConfig, p: argparse.ArgumentParser, plan, hetero: HeteroRunConfig | None,
                save_lock, a: argparse.Namespace | None = None) -> dict:
    """This process is one rank of a torchrun (or SLURM) job. A failure prints its error (one
    line for a user's error, else the traceback) and ends the process at once: the other ranks
    may be blocked in a collective with it, and only the process ending lets torchrun's
    kill-on-bad-exit stop them (otherwise they wait for the collective timeout, 10 minutes on
    NCCL). A clean end destroys the process group, as Megatron-LM does."""
    import torch.distributed as dist

    from megatron_hetermoe.errors import user_message, want_traceback

    rank = int(os.environ["RANK"])
    try:
        if save_lock is not None:
            save_lock.acquire()
        from megatron_hetermoe.parallel.device import init_distributed, rank_device

        device = init_distributed()  # this rank's GPU first, then NCCL (gloo and CPU patches without CUDA)
        if plan is AUTO:
            plan = _auto_plan_at_start(a, cfg, hetero, device)
        check_kernels(p, cfg, rank_device(), hetero.pools(cfg) if plan is not None else None)
        result = _rank_main(rank, int(os.environ["WORLD_SIZE"]), cfg, plan, hetero)
    except BaseException as e:  # noqa: BLE001 - every failure ends this rank now
        code = 1
        line = user_message(e) if isinstance(e, Exception) else None
        if isinstance(e, SystemExit):  # argparse's error (already printed), or an exit with a message
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(f"error: rank {rank}: {e.code}", file=sys.stderr)
        elif line is not None and not want_traceback():
            print(f"error: rank {rank}: {line}", file=sys.stderr)
        else:
            print(f"rank {rank} failed:", file=sys.stderr)
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


AUTO = "auto"  # --hetero-plan auto under torchrun: planned at start, once every rank's GPU is known


def joining_torchrun(a: argparse.Namespace) -> bool:
    """This process is a rank of a torchrun (or SLURM) job rather than the launcher of forked ranks."""
    return "RANK" in os.environ and a.nproc is None


def validate_run(p: argparse.ArgumentParser, a: argparse.Namespace, check_outputs: bool = True):
    """Every input of a run, checked before any process group (torchrun's or ours) exists; the
    first bad one ends in p.error. Returns (TrainConfig, plan or None, HeteroRunConfig, whether
    the run joins a torchrun job). check_outputs=False skips the paths the run writes (the SLURM
    renderer checks a job's flags on a login node, where they need not exist yet)."""
    check_launch_flags(p, a)
    try:
        cfg = config_from_args(a)
    except (ValueError, FileNotFoundError) as e:  # a bad model config, --seq-length, parallel size
        p.error(str(e))
    if not a.hetero_plan and (a.hetero_schedule or a.timeline_dir or a.hetero_expert_precision
                              or a.hetero_zebra_issuer != "auto"):
        raise SystemExit("--hetero-schedule, --timeline-dir, --hetero-expert-precision and --hetero-zebra-issuer "
                         "need --hetero-plan")
    if a.hetero_replan_interval < 0 or not a.hetero_replan_margin >= 0:
        p.error(f"--hetero-replan-interval {a.hetero_replan_interval} --hetero-replan-margin "
                f"{a.hetero_replan_margin}: give steps >= 0 (0: never) and a factor >= 0")
    if a.hetero_replan_interval and not a.hetero_plan:
        p.error(f"--hetero-replan-interval {a.hetero_replan_interval} needs --hetero-plan: it moves HeterMoE's "
                f"experts between the plan's ranks")
    hetero = hetero_run_config(a, a.recompute_granularity == "full", a.timeline_dir)
    if a.elastic_restarts < 0:
        p.error(f"--elastic-restarts {a.elastic_restarts}: give the number of restarts, >= 0")
    if a.elastic_restarts and not a.hetero_plan:
        p.error(f"--elastic-restarts {a.elastic_restarts} needs --hetero-plan (a plan file, or auto): a restart "
                f"re-plans HeterMoE for the GPUs left")
    if a.elastic_restarts and not (a.save and a.save_interval):
        p.error(f"--elastic-restarts {a.elastic_restarts} needs --save DIR and --save-interval N: a restart "
                f"continues from the latest checkpoint, and a job loses the iterations since it")
    if a.elastic_restarts and joining_torchrun(a):
        p.error(f"--elastic-restarts {a.elastic_restarts} restarts the ranks this command forks; under torchrun "
                f"its elastic agent restarts them (torchrun --nnodes MIN:MAX --max-restarts N) and each start "
                f"plans for the world it got with --hetero-plan auto (--load and --hetero-ckpt-reshard continue "
                f"from the latest checkpoint): drop --elastic-restarts")
    if a.hetero_gpus and not a.hetero_plan:
        p.error("--hetero-gpus needs --hetero-plan auto (or a plan file with --elastic-restarts)")
    plan = None
    if a.hetero_plan:
        from megatron_hetermoe.plan.hetero_plan import HeteroPlan

        try:
            if a.hetero_plan == "auto" and joining_torchrun(a) and not a.hetero_gpus:
                plan = AUTO  # planned at start, from every rank's GPU (_run_joined)
            elif a.hetero_plan == "auto":
                plan = _auto_plan(a, cfg, inventory_of(p, a))
            else:
                plan = HeteroPlan.load(a.hetero_plan)
        except (ValueError, OSError) as e:
            p.error(f"--hetero-plan: {e}")
        # TP and PP with a plan (its attention_tp and pipeline_stages) and EP (replaced by the plan) are
        # validation.check_hetero's to judge, in validate_job below.
        if plan is not AUTO and a.nproc not in (None, plan.world_size):
            raise SystemExit(f"--nproc {a.nproc} but the plan has {plan.world_size} ranks; drop --nproc")
        if "RANK" not in os.environ:  # under torchrun, join its ranks instead of forking more
            a.nproc = plan.world_size
    if a.recompute_granularity == "full" and plan is not AUTO and \
            (not a.hetero_plan or (a.hetero_schedule or plan.schedule) != ScheduleName.ZEBRA):
        p.error("--recompute-granularity full: this trainer recomputes only under the zebra schedule (--hetero-plan, "
                "--hetero-schedule zebra or a zebra plan); here it would do nothing; drop it, or run zebra")
    joining = joining_torchrun(a)
    world = int(os.environ.get("WORLD_SIZE", 0)) if joining else (a.nproc or 4)
    try:  # every input, before any process group (torchrun's or ours) exists
        from megatron_hetermoe.outputs import check_output_paths
        from megatron_hetermoe.reliability.faults import check_env
        from megatron_hetermoe.training.validation import validate_job

        if plan is not AUTO:  # else once the plan is made, at start (_run_joined)
            validate_job(cfg, world, plan if a.hetero_plan else None, a.hetero_schedule, hetero)
        check_env(world)  # $HETERMOE_INJECT_FAULT, read by every rank
        if check_outputs and int(os.environ.get("RANK", "0")) == 0:  # rank 0 of a torchrun job checks them
            check_output_paths(a)
    except ValueError as e:
        p.error(str(e))
    return cfg, plan if a.hetero_plan else None, hetero, joining


def inventory_of(p: argparse.ArgumentParser, a: argparse.Namespace, plan=None):
    """The job's GPUs (planner/inventory.py): --hetero-gpus, else the plan's GPU types."""
    from megatron_hetermoe.planner.inventory import Inventory

    if a.hetero_gpus:
        try:
            return Inventory.from_spec(a.hetero_gpus)
        except ValueError as e:
            p.error(str(e))
    if plan is None:
        p.error("--hetero-plan auto needs --hetero-gpus on CPU ranks (the GPUs to plan for: a cluster config, or "
                "GPU types like 4xA40,4xV100-16GB)")
    return Inventory.from_types(plan.gpu_types)


def plan_run_of(cfg: TrainConfig, a: argparse.Namespace):
    """What the run fixes for --hetero-plan auto's search: model, batch, TP, PP, the schedule."""
    from megatron_hetermoe.planner.inventory import AutoPlanRun

    return AutoPlanRun(cfg.model, cfg.model.seq_length, cfg.global_batch_size, cfg.micro_batch_size,
                       cfg.parallel.tp, cfg.parallel.pp, cfg.use_distributed_optimizer, a.hetero_schedule)


def _auto_plan(a: argparse.Namespace, cfg: TrainConfig, inventory):
    """--hetero-plan auto: the planner's pick for `inventory`, printed by the first rank. Under
    torchrun (a rank on every GPU) a pick that leaves GPUs idle is refused (InventoryError); forked
    ranks run only the GPUs it keeps."""
    from megatron_hetermoe.planner.inventory import InventoryError, auto_plan
    from megatron_hetermoe.training.elastic import describe_plan

    plan, kept = auto_plan(plan_run_of(cfg, a), inventory)
    idle = [i for i in range(inventory.size) if i not in kept]
    if idle and joining_torchrun(a):
        raise InventoryError(f"the best plan for {inventory.describe()} leaves rank(s) {idle} idle (the batch does "
                             f"not split over the attention ranks the others give); start the job without them, or "
                             f"change the batch")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f" --hetero-plan auto: {describe_plan(plan)} (for this job's {inventory.describe()}; the planner's "
              f"search)"
              + (f"; GPU(s) {idle} of the inventory idle: the batch does not split over the attention ranks with "
                 f"them" if idle else ""), flush=True)
    return plan


def run_from_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Validate, launch (forked CPU ranks or the surrounding torchrun job) and report a run."""
    cfg, plan, hetero, joining = validate_run(p, a)
    from megatron_hetermoe.checkpoint.lock import SaveLock

    # One run per --save directory, held by the launching process (and so its forked ranks),
    # or by rank 0 of a torchrun job.
    save_lock = SaveLock(cfg.save) if cfg.save and int(os.environ.get("RANK", "0")) == 0 else None
    if cfg.nan_check_mode() != cfg.check_for_nan_in_loss_and_grad and int(os.environ.get("RANK", "0")) == 0:
        print("WARNING: --check-for-nan-in-loss-and-grad is off: --fp16 with a dynamic loss scale skips steps "
              "whose gradients overflow (as Megatron-LM does)", file=sys.stderr)
    if joining:
        result = _run_joined(cfg, p, plan, hetero, save_lock, a)
    else:
        import megatron.core  # noqa: F401  - import once in the parent, then fork ranks

        check_kernels(p, cfg, "cpu", hetero.pools(cfg) if plan is not None else None)  # forked ranks are CPU ranks
        try:
            if save_lock is not None:
                save_lock.acquire()
        except ValueError as e:  # OutputPathError: --save is a file, or cannot be written
            p.error(str(e))
        try:
            if a.elastic_restarts:
                result = _run_elastic(p, a, cfg, plan, hetero)
            else:
                result = run(cfg, a.nproc or 4, plan=plan, hetero=hetero,
                             progress_timeout_s=a.progress_timeout or None)
        finally:
            if save_lock is not None:
                save_lock.release()
    if result.peak_rss_mib is not None and int(os.environ.get("RANK", "0")) == 0:
        for r, (role, rss) in enumerate(result.peak_rss_mib):
            print(f" rank {r} ({role}): peak RSS {rss:.0f} MiB")
        if result.schedule == ScheduleName.ZEBRA:
            print(f" rank 0 peak activation memory (saved for backward): {result.peak_activation_mib:.2f} MiB")
    if result.peak_gpu_mib is not None and int(os.environ.get("RANK", "0")) == 0:  # CUDA ranks (both trainers)
        for r, (role, mib) in enumerate(result.peak_gpu_mib):
            print(f" rank {r} ({role}): peak GPU memory {mib:.0f} MiB (max allocated)")
    if result.emulation is not None and int(os.environ.get("RANK", "0")) == 0:
        from megatron_hetermoe.emulation.validity import validity_line

        print(" " + validity_line("timing", result.emulation))
    if a.golden_values_out and int(os.environ.get("RANK", "0")) == 0:
        from megatron_hetermoe.training.golden_values import write_golden

        # Steps are numbered by iteration: a run resumed at iteration 3 writes steps 4, 5, ...
        write_golden(a.golden_values_out, result.losses, start_step=result.start_iteration + 1)
    return 0


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe train", main))
