"""--hetero-replan-interval inside Megatron-LM's pretrain() (issue 46 item 4, the second hosting).

The plugin trainer's Replanner (training/replan.py) decides and moves, as in `hetermoe train`:
every K steps the interval's loads and task seconds (the schedule's TimelineRecorder: CUDA events
on GPU ranks, host timers on CPU ranks), the first rank's decision broadcast, the moved experts'
whole states sent point to point. What differs is how a rank's objects are built again, because
Megatron-LM's train() holds them for the whole run: the model chunks in a list, the optimizer in a
local variable (its LR scheduler holds it too), the forward-backward function from before its loop.
A move, at the end of a step (training.post_training_step_callbacks: after the step's log and
evaluation, before its checkpoint), on every rank:
- builds the model again with the call pretrain() made (training.get_model: the same
  model_provider, so HeterMoE's builder for the new plan, Megatron's Float16Module and DDP), from
  the moved states instead of an initialization, and puts its chunks into train()'s list;
- builds the optimizer again with the call pretrain() made (through HeterMoE's optimizer hook)
  and makes train()'s optimizer object that optimizer (shims adopt_in_place); the main parameters
  and Adam state are put back (expert_move.load_optimizer_states), the loss scaler's state carries
  over, and the LR scheduler sets the new parameter groups' learning rate for its step (step(0));
- gives the new chunks' model config what train() set on the old one (the loss-scale function,
  the timers, finalize_model_grads);
- builds the schedule's task lists for the new plan (hooks.py's step function reads them at each
  call) and saves the new plan in the flags Megatron keeps with each checkpoint, so a checkpoint
  saved after the move records the plan it was saved on.
"""
from __future__ import annotations

import dataclasses

from megatron_hetermoe.config import HeteroRunConfig

# What Megatron-LM's train() sets on the model config before its loop (read by the schedule
# through the chunks' config, which a rebuilt model brings anew).
TRAIN_SET_CONFIG = ("timers", "finalize_model_grads_func", "no_sync_func", "grad_sync_func", "param_sync_func")


@dataclasses.dataclass
class _Role:
    """What the Replanner reads of the rank: its module, canonical names and training step function."""
    module: object
    names: dict[str, str]
    fwd_bwd: object


@dataclasses.dataclass
class _Quiet:
    quiet: bool = False


@dataclasses.dataclass
class _Parts:
    optimizer: object
    cfg: _Quiet = dataclasses.field(default_factory=_Quiet)


@dataclasses.dataclass
class _Rebuilt:
    module: object
    names: dict[str, str]
    optimizer: object


class PretrainMoves:
    """The live moves of one pretrain() rank. `hp`: the run's HeteroPretrain (hooks.py), which
    hands over what a rebuild needs: get_model's and get_megatron_optimizer's calls, the builder's
    canonical names, the schedules."""

    def __init__(self, hp, run: HeteroRunConfig):
        self.hp, self.run = hp, run
        self.replanner = None
        self.model: list | None = None
        self.optimizer = None
        self.scheduler = None

    def after_step(self, model: list, optimizer, scheduler, iteration: int) -> None:
        from megatron_hetermoe.models.builder import unwrap
        from megatron_hetermoe.training.replan import Replanner

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        if self.replanner is None:
            role = _Role(unwrap(model[0]), self.hp.names, self.hp.schedules[0])
            self.replanner = Replanner(self.hp.hs, self.run, None, self.hp.loads, role, _Parts(optimizer),
                                       self._rebuild, self._pricing())
        self.replanner(iteration)  # a move rebuilds the objects in place: train() keeps the same ones

    def _pricing(self):
        """planner/rebalance.run_pricing for this run's model, batch and GPUs (the model from the
        command line, as `hetermoe plan -- <flags>` reads it), or None: a GPU type without a
        shipped profile (CPU ranks), or flags the planner does not read (said on the first rank)."""
        from megatron.training import get_args

        from megatron_hetermoe.errors import UserError
        from megatron_hetermoe.megatron_lm.auto_plan import padded_vocab
        from megatron_hetermoe.planner.megatron_flags import model_from_flags
        from megatron_hetermoe.planner.rebalance import RebalanceConfig, run_pricing, simulator_prices

        plan, args = self.hp.plan, get_args()
        if not simulator_prices(plan.gpu_types):  # before reading the model from the flags
            return None
        flags = [t for t in self.hp.argv if not t.startswith("--hetero-")]
        vocab = padded_vocab(args)
        if vocab is not None:
            flags += ["--padded-vocab-size", str(vocab)]
        try:
            model = model_from_flags(flags, megatron_parsed=True).model
        except UserError as e:
            if args.rank == 0:
                print(f"> HeterMoE live moves: the simulator cannot price this model ({e}); the measured-time "
                      f"rule decides", flush=True)
            return None
        return run_pricing(plan, model, args.seq_length, args.global_batch_size, args.use_distributed_optimizer,
                           self.hp.recompute, RebalanceConfig(margin=self.run.replan_margin))

    def _rebuild(self, kept: dict) -> _Rebuilt:
        """The rank's objects for hs's (new) plan from the moved whole states (module docstring)."""
        from megatron.core.utils import get_model_config
        from megatron.training import get_args

        from megatron_hetermoe.megatron_lm.checkpoints import PLAN_ARG
        from megatron_hetermoe.models.builder import unwrap
        from megatron_hetermoe.shims.megatron_training import adopt_in_place
        from megatron_hetermoe.training.expert_move import carry_loss_scale
        from megatron_hetermoe.training.hetero import carry_buffers

        hp, role = self.hp, self.replanner.role
        built = getattr(hp.schedules[1], "keywords", {}).get("built")
        if built is not None:
            built.close()  # the evaluation's task lists (the Replanner closes the training one's)
        hp.plan = hp.hs.plan
        setattr(get_args(), PLAN_ARG, hp.plan.to_json())
        old_config = get_model_config(self.model[0])
        chunks = hp.rebuild_model({n: st.param for n, st in kept.items()})
        module = unwrap(chunks[0])
        carry_buffers(role.module, module)  # a router's expert bias lives on attention ranks
        new = hp.rebuild_optimizer(chunks)
        carry_loss_scale(self.optimizer, new)
        adopt_in_place(self.optimizer, new)
        self.model[:] = chunks
        config = get_model_config(chunks[0])
        for name in TRAIN_SET_CONFIG:
            setattr(config, name, getattr(old_config, name, None))
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler.step(0)  # the new parameter groups' learning rate and weight decay for this step
        train = hp.rebuild_schedules()
        role.module, role.names, role.fwd_bwd = module, hp.names, train
        return _Rebuilt(module, hp.names, self.optimizer)


def replan_refusals(args, plan) -> list[str]:
    """The flags a --hetero-replan-interval run of pretrain() cannot honour, with the reason."""
    if not getattr(args, "hetero_replan_interval", 0):
        return []
    out = []
    if plan.virtual_stages > 1:
        out.append(f"--hetero-replan-interval with a plan of {plan.virtual_stages} virtual stages: live moves "
                   f"rebuild one model chunk a rank; give the plan virtual_stages 1")
    why = "live moves rebuild the model and optimizer, and this keeps state of the old ones across steps"
    for flag, dest in (("--overlap-grad-reduce", "overlap_grad_reduce"),
                       ("--overlap-param-gather", "overlap_param_gather"),
                       ("--ckpt-assume-constant-structure", "ckpt_assume_constant_structure"),
                       ("--async-save", "async_save")):
        if getattr(args, dest, False):
            out.append(f"{flag} with --hetero-replan-interval: {why}; drop {flag}")
    return out

