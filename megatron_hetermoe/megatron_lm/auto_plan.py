"""`--hetero-plan auto` inside Megatron-LM's pretrain(): the run plans itself for the GPUs it finds.

The inventory is every rank's GPU, gathered over torch.distributed (which this joins early, in
validate_args: Megatron-LM's own initialization then finds it joined and keeps it), or
`--hetero-gpus` (a cluster config or GPU types, one per rank: CPU ranks have no GPU to ask, or set
$HETERMOE_GPU_TYPE). The model, batch and layout are the command line's, read as `hetermoe plan ...
-- <flags>` reads them (planner/megatron_flags.py), so the plan is the one that command would make
for these GPUs; the search is planner/inventory.auto_plan, the plugin trainer's. Every rank plans
alike (the search is deterministic). Under torchrun's elastic agent each start plans again for the
world it got, and a checkpoint saved on another plan loads resharded (megatron_lm/checkpoints.py).
"""
from __future__ import annotations

import copy
import datetime
import os

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.inventory import AutoPlanRun, Inventory, InventoryError, auto_plan
from megatron_hetermoe.planner.megatron_flags import model_from_flags
from megatron_hetermoe.vocabulary import ScheduleName


def padded_vocab(args) -> int | None:
    """The vocabulary Megatron-LM will pad the tokenizer's to (its own build_tokenizer, on a copy
    of the flags), for a tokenizer the planner does not read; None for NullTokenizer or when
    --padded-vocab-size is given (the planner reads those flags itself)."""
    if args.tokenizer_type in (None, "NullTokenizer") or getattr(args, "padded_vocab_size", None):
        return None
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # megatron-core >= 0.19
    except ImportError:
        from megatron.training.tokenizer import build_tokenizer
    probe = copy.copy(args)
    build_tokenizer(probe)
    return probe.padded_vocab_size


def run_of_flags(argv: list[str], schedule: str | None, padded_vocab: int | None = None,
                 megatron_parsed: bool = True) -> AutoPlanRun:
    """What the search keeps fixed, from a pretrain_gpt.py command line: the model, batch and layout
    (`padded_vocab`: the vocabulary Megatron pads the tokenizer's to, where the planner cannot read
    the tokenizer). InventoryError for what the search does not price."""
    flags = [t for t in argv if not t.startswith("--hetero-")]
    if padded_vocab is not None:
        flags += ["--padded-vocab-size", str(padded_vocab)]
    fm = model_from_flags(flags, megatron_parsed=megatron_parsed)
    run = fm.run
    if fm.global_batch_size is None:
        raise InventoryError("--hetero-plan auto needs --global-batch-size: Megatron's default (micro batch x "
                             "data-parallel size) depends on the plan the search is to pick")
    if run.virtual_stages > 1:
        raise InventoryError(f"--hetero-plan auto with virtual pipeline size {run.virtual_stages}: the planner's "
                             f"search does not price virtual stages; make the plan with `hetermoe plan --even ... "
                             f"-- <these flags>` and pass its path")
    if run.first_stage_layers is not None or run.last_stage_layers is not None:
        raise InventoryError("--hetero-plan auto with --decoder-first/last-pipeline-num-layers: the search prices "
                             "Megatron's even pipeline split only; make the plan with `hetermoe plan --even ... -- "
                             "<these flags>` and pass its path")
    if run.recompute.full:
        if schedule not in (None, ScheduleName.ZEBRA):
            raise InventoryError(f"--hetero-schedule {schedule} with --recompute-granularity full: only zebra "
                                 f"recomputes (per attention stage); drop one")
        schedule = ScheduleName.ZEBRA
    return AutoPlanRun(fm.model, fm.seq_length or fm.model.seq_length, fm.global_batch_size, run.micro_batch_size,
                       run.tensor_model_parallel_size, run.pipeline_model_parallel_size, run.distributed_optimizer,
                       schedule, context_parallel=run.context_parallel_size)


def flag_value(argv: list[str], name: str) -> str | None:
    """The last value of `name` on a command line (`--x v` or `--x=v`), as argparse takes it."""
    out = None
    for i, t in enumerate(argv):
        if t == name and i + 1 < len(argv):
            out = argv[i + 1]
        elif t.startswith(name + "="):
            out = t.split("=", 1)[1]
    return out


def _every_gpu_used(run: AutoPlanRun, inventory: Inventory, fix: str) -> HeteroPlan:
    """The planner's pick for `inventory`; InventoryError where it leaves a GPU idle (every rank of a
    torchrun or SLURM job is a GPU that must have work)."""
    plan, kept = auto_plan(run, inventory)
    idle = [i for i in range(inventory.size) if i not in kept]
    if idle:
        raise InventoryError(f"--hetero-plan auto: the best plan for {inventory.describe()} leaves GPU(s) {idle} "
                             f"idle (the global batch {run.global_batch_size} does not split over the attention "
                             f"ranks the others give); {fix}")
    return plan


def pick_for(argv: list[str], inventory: Inventory) -> HeteroPlan:
    """The plan every start of a job with these flags would pick for `inventory` (the SLURM
    renderer's check, before anything runs)."""
    return _every_gpu_used(run_of_flags(argv, flag_value(argv, "--hetero-schedule")), inventory,
                           "change the batch or the allocation")


def _inventory(args) -> Inventory:
    if getattr(args, "hetero_gpus", None):
        inventory = Inventory.from_spec(args.hetero_gpus)
        if inventory.size != args.world_size:
            raise InventoryError(f"--hetero-gpus {args.hetero_gpus} gives {inventory.size} GPUs but the job has "
                                 f"{args.world_size} ranks; give one GPU type per rank")
        return inventory
    import torch.distributed as dist

    from megatron_hetermoe.parallel.device import init_distributed, rank_device
    from megatron_hetermoe.training.elastic import gather_inventory

    if dist.is_initialized():
        import torch

        device = rank_device(cuda=torch.cuda.is_available())
    else:
        timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
        device = init_distributed(args.distributed_backend, timeout=timeout)
    return gather_inventory(device)


def plan_for_job(args, argv: list[str]) -> HeteroPlan:
    """The planner's pick for this job's GPUs and these flags (every GPU used)."""
    run = run_of_flags(argv, getattr(args, "hetero_schedule", None), padded_vocab(args))
    inventory = _inventory(args)
    plan = _every_gpu_used(run, inventory, "start the job without them, or change the batch")
    if int(os.environ.get("RANK", args.rank)) == 0:
        from megatron_hetermoe.training.elastic import describe_plan

        print(f"> HeterMoE: --hetero-plan auto: {describe_plan(plan)} (the planner's search for this job's "
              f"{inventory.describe()})", flush=True)
    return plan
