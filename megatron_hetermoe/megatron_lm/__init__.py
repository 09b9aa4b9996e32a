"""HeterMoE inside Megatron-LM: what the patched pretrain_gpt.py (patches/) imports.

The hook that the patches in patches/ put into Megatron-LM's pretrain_gpt.py.

One patch per Megatron-LM release line, since pretrain_gpt.py differs between them (PATCHES):
core_v0.16.1 hands `extra_args_provider` to `pretrain(...)`; core_v0.19.0 parses the arguments
itself with `parse_and_validate_args(extra_args_provider=...)` before calling `pretrain`.
`patch_for(checkout)` names the patch for a checkout (patches/check_patch.sh does the same).

The patched pretrain_gpt.py gets the --hetero-* flags through `extra_args_provider`
(`add_hetero_args`), so Megatron-LM's parser and --help know them. Without --hetero-plan nothing
changes where CUDA exists (on a host without it, `megatron_on_cpu` runs Megatron's own pretrain()
over gloo on CPU ranks). With it, on both release lines, Megatron-LM's own pretrain() runs on every
rank, attention and expert alike, with the plugin's group setup, model builder, schedule and global
gradient norm in place (`hetero_pretrain`, hooks.py). On core_v0.19.0 the patch also routes
pretrain_gpt.py's parse_and_validate_args through the hooks (`parse_with_hooks`: validate_args
runs there, before pretrain()), passes model_provider with the plugin's builder, and pretrain()
drops the config container's model so Megatron builds it with that model_provider. What else
differs between the releases is decided in compat.py (megatron_lm_* rules) or by the object at hand
(shims/megatron_training.py, shims/parallel_state.py: the "with GTP_remat" groups, the MoE and MTP
metric trackers). Every replacement of Megatron-LM's functions is made by shims/ (the hooks pass
their behaviour in: shims/megatron_training.py PretrainHooks).

Inside pretrain() (hooks.py):
Every rank, attention and expert alike, runs Megatron-LM's pretrain(): initialize_megatron,
setup_model_and_optimizer, the dataset builders, train() with its timers, rerun state machine,
logging and exit checks, and evaluate(). Every world-wide collective of that loop is therefore
entered by every rank by construction. HeterMoE changes five things, each through a hook that
`HeteroPretrain.installed()` puts in place for the call and takes out after it:

1. validate_args: flags this path cannot honour are refused by name (`refusals`), the plan is read
   (or made for the job's GPUs: `auto_plan`), and Megatron's data-parallel size (hence its
   microbatch calculator) is the plan's attention ranks (core_v0.16.1: inside pretrain()'s
   initialize_megatron; core_v0.19.0: in pretrain_gpt.py's parse_and_validate_args, before
   pretrain()); a checkpoint saved on another plan is found there and loads resharded
   (`checkpoints`).
2. Model parallel state: megatron's initialize_model_parallel is replaced by the plan's groups
   (parallel/state.py), installed into megatron-core's parallel_state
   (parallel/megatron_globals.py install_parallel_state, written by shims/parallel_state.py).
3. The model: `HeteroPretrain.builder`, a Megatron-LM model builder (pretrain_gpt.py's
   model_provider calls it): Megatron's config and layer spec from the flags, with HeteroMoELayer
   on attention ranks and the expert-only ExpertRuntime on expert ranks.
4. The schedule: Megatron-LM's get_forward_backward_func returns the plan's schedule (distep or
   zebra; forward-only passes run distep's forward on both roles). Expert ranks report the
   world's lm loss, so whichever rank prints sees the same numbers.
5. The optimizer: Megatron's own, with its gradient norm taken over the world (each gradient
   counted once: dense ones on attention DP rank 0, experts on ZP group 0), so both roles clip by
   one global norm and agree on every step; with --fp16 (or --bf16 with a loss scale) one loss
   scale for the world (training/step.py share_loss_scale).
On a host without CUDA the CPU backend (parallel/cpu_backend.py) runs the same path over gloo.

Modules: `pretrain` (`hetermoe pretrain`: a patched checkout's pretrain_gpt.py, or megatron-core
>= 0.19's own pretrain() with this package's GPT providers and no checkout), `hooks` (HeteroPretrain
and hetero_pretrain), `refusals` (the flags refused by name), `replaced` (the flags accepted with a
line naming what replaces them, and recomputation), `auto_plan` (--hetero-plan auto: the plan for
the GPUs the job finds), `checkpoints` (the plan a checkpoint was saved on; loading it into
another plan), `cpu_layer` (pretrain() on CPU ranks, and
megatron_on_cpu for a plain Megatron run); which patch fits a checkout is shims/pretrain_gpt.py's
(re-exported here). The --hetero-* flags are cli/hetero.py's, the plugin trainer's too.
"""
from __future__ import annotations

from megatron_hetermoe.cli.hetero import add_hetero_args
from megatron_hetermoe.cli.pretrain import hetero_plan_parser
from megatron_hetermoe.megatron_lm.cpu_layer import megatron_on_cpu
from megatron_hetermoe.megatron_lm.hooks import hetero_pretrain
from megatron_hetermoe.shims.pretrain_gpt import PATCHES, checkout_version, patch_for

__all__ = ["add_hetero_args", "hetero_pretrain", "megatron_on_cpu", "hetero_requested", "patch_for",
           "checkout_version", "PATCHES"]


def hetero_plan_path(argv: list[str]) -> str | None:
    """The --hetero-plan this command line gives (None: a plain Megatron run)."""
    known, _ = hetero_plan_parser().parse_known_args(argv)
    return known.hetero_plan


def hetero_requested(argv: list[str]) -> bool:
    """Whether this command line asks for HeterMoE (--hetero-plan given)."""
    return hetero_plan_path(argv) is not None
