"""Which plan a Megatron-LM checkpoint was saved on, and loading it into another plan.

Every --hetero-plan run of pretrain() keeps its plan in the flags Megatron saves with each
checkpoint (`args.hetero_plan_json`). Before Megatron loads one, `resume_plan` reads the plan it was
saved on from the checkpoint's common state (the file Megatron reads first). On the same plan
everything loads as saved. On another one (an elastic restart that planned again for the GPUs left,
`--hetero-plan auto`, or a plan the user changed) the model's weights and Adam's moments load by
parameter name (canonical expert ids: any placement), the LR schedule, iteration and consumed
samples as saved, the optimizer's step and loss scaler from the object every layout can read
(checkpoint/megatron_optimizer.py); the per-rank RNG states are not loaded (a rank of one plan has
no counterpart in another: Megatron ignores the RNG state likewise when TP or PP change), with a
line that says so. The distributed optimizer loads across plans from Megatron's fully reshardable
format (--dist-ckpt-optim-fully-reshardable: each parameter's state whole); its default format
(dp_reshardable) keys the state by data-parallel group, which another plan does not have: refused
with the way out.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.plan.hetero_plan import HeteroPlan

PLAN_ARG = "hetero_plan_json"  # the flags' attribute that carries the plan into every checkpoint


class ResumeError(UserError, ValueError):
    """A checkpoint this run cannot load as asked (the message says what to change)."""


def _checkpoint_dir(args) -> Path | None:
    """The persistent checkpoint Megatron-LM's load_checkpoint will read (None: none), found as it
    finds it: --ckpt-step, else the tracker file's iteration ("release" too, which the plugin's own
    format.read_tracker refuses)."""
    from megatron_hetermoe.checkpoint.format import TRACKER, iter_dir_name

    if not args.load or getattr(args, "finetune", False):
        return None
    load = Path(args.load)
    step = getattr(args, "ckpt_step", None)
    if step is None:
        tracker = load / TRACKER
        if not tracker.is_file():
            return None
        text = tracker.read_text().strip()
        if text == "release":
            return load / "release"
        step = int(text)
    path = load / iter_dir_name(step)
    return path if path.is_dir() else None


def _saved_args(path: Path | None):
    """The flags the checkpoint at `path` was saved with (None: no checkpoint to load)."""
    if path is None:
        return None
    from megatron.core import dist_checkpointing

    # common.pt (core_v0.16.1), or the "common_state" object in the checkpoint (core_v0.19.0): both read
    # by dist_checkpointing, on this rank alone.
    return dist_checkpointing.load_common_state_dict(str(path)).get("args")


def _plan_of(saved_args) -> HeteroPlan | None:
    """The plan a checkpoint was saved on; None where it was saved without one (Megatron EP's, or a
    HeterMoE one from before plans were kept)."""
    saved = getattr(saved_args, PLAN_ARG, None)
    return None if saved is None else HeteroPlan.from_dict(json.loads(saved))


def resume_plan(args, plan: HeteroPlan) -> bool:
    """Whether the checkpoint to load was saved on another plan than `plan`; if so, set the flags
    for loading it there (no RNG state) and say so on the first rank. ResumeError where it cannot
    load there."""
    ckpt = _checkpoint_dir(args)
    saved = _saved_args(ckpt)
    old = _plan_of(saved)
    if old is None or old.to_dict() == plan.to_dict():
        return False
    loads_optimizer = not args.no_load_optim
    if loads_optimizer and args.use_distributed_optimizer and not getattr(saved, "dist_ckpt_optim_fully_reshardable",
                                                                          False):
        raise ResumeError(
            f"{ckpt} was saved on another plan ({old.world_size} ranks: {_roles(old)}) than this run's "
            f"({plan.world_size} ranks: {_roles(plan)}); the distributed optimizer's state is keyed by "
            f"data-parallel group in Megatron's default format (dp_reshardable), and the groups differ between "
            f"the plans, so it does not load here: pass --no-load-optim (weights, LR schedule and samples still "
            f"load); save with --dist-ckpt-optim-fully-reshardable to keep it loadable across plans")
    if not args.no_load_rng:
        args.no_load_rng = True
    if int(os.environ.get("RANK", args.rank)) == 0:
        what = "weights, Adam's moments and step" if loads_optimizer else "weights (--no-load-optim)"
        print(f"> HeterMoE: the checkpoint was saved on another plan ({old.world_size} ranks: {_roles(old)}); "
              f"loading its {what}, LR schedule and consumed samples into this run's ({plan.world_size} ranks: "
              f"{_roles(plan)}); the per-rank RNG states are not loaded", flush=True)
    return True


def _roles(plan: HeteroPlan) -> str:
    return f"{len(plan.attention_ranks)} attention + {len(plan.expert_ranks)} expert"
