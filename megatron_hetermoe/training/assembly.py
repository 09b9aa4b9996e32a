"""How a HeterMoE rank is put together, in one place for both hostings: the plugin's trainer
(training/hetero.py) and Megatron-LM's own pretrain() (megatron_lm/hooks.py), which builds the
DDP wrapper and the optimizer itself and calls these pieces from its hooks.

- `model_config`: the role's TransformerConfig as HeterMoE needs it.
- `RoleAssembly.module`: the role's module, from Megatron's config and layer spec (GPTModel with
  HeteroMoELayer on attention ranks, the expert-only ExpertRuntime on expert ranks), every
  parameter at its layout-invariant initial value (or a given Megatron state dict's).
- `RoleAssembly.configure_optimizer`: Megatron's optimizer on a HeterMoE rank (the global norm,
  one loss scale, megatron-core 0.19's separate grad-norm groups decided once over the world).
- `RoleAssembly.schedule`: the step function of this rank, with megatron-core's keywords.
- `RoleAssembly.finish_gradients`: the expert ranks' share of the data-parallel average.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_hetermoe.config import HeteroRunConfig, PoolPrecision
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.shims import distributed_data_parallel, megatron_optimizer
from megatron_hetermoe.training.world_stats import world_count_zeros, world_grad_norm
from megatron_hetermoe.vocabulary import Role


def model_config(config, hs: HeteroParallelState | None = None, **overrides):
    """A role's TransformerConfig: Megatron's `config` with expert_model_parallel_size > 1, which
    marks expert weights allreduce=False (Megatron's expert parameters), so DDP reduces them over
    the expert replica group and the optimizer keeps them in their own sub-optimizer. With `hs`,
    the role's tensor and context parallelism: an attention member's (the plan's attention_tp,
    sequence parallel when > 1, and attention_cp) and pipeline stages (the plan's pipeline_stages
    and virtual_stages), none on
    an expert rank (it holds its stage's experts whole, for all of the stage's model chunks, in one
    module); experts are never tensor-parallel here."""
    if hs is not None:
        attention = hs.role == Role.ATTENTION
        t = hs.plan.attention_tp if attention else 1
        V = hs.plan.virtual_stages
        overrides = {"tensor_model_parallel_size": t, "sequence_parallel": t > 1, "expert_tensor_parallel_size": 1,
                     "context_parallel_size": hs.plan.attention_cp if attention else 1,
                     "pipeline_model_parallel_size": hs.plan.pipeline_stages if attention else 1,
                     "virtual_pipeline_model_parallel_size": V if attention and V > 1 else None, **overrides}
        if not attention:  # outside Megatron's pipeline: no stage of an uneven split either
            overrides = {"num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
                         **overrides}
    return dataclasses.replace(config, expert_model_parallel_size=2, **overrides)


def _grad_norm_groups_once(optimizer, hs: HeteroParallelState) -> None:
    """megatron-core 0.19 clips some parameters (the MTP block's) by a norm of their own, and each
    (sub-)optimizer asks once, at its first step, whether any rank holds such parameters: an
    all_reduce per sub-optimizer. HeterMoE ranks hold different numbers of sub-optimizers (dense
    only, dense + Asym-EA experts, experts only), so those reductions would pair up wrongly and
    hang; the answer is taken here instead, one reduction over the world, the same on every rank
    (megatron-core 0.16 has no such groups: nothing to do)."""
    try:
        from megatron.core.optimizer.optimizer import (
            GRAD_NORM_GROUP_ATTR,
            SEPARATE_GRAD_NORM_GROUPS,
        )
    except ImportError:
        return
    import torch.distributed as dist

    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for group in SEPARATE_GRAD_NORM_GROUPS:
        local = any(getattr(p, GRAD_NORM_GROUP_ATTR, None) == group for opt in subs for p in opt.get_parameters())
        flag = torch.tensor([int(local)], dtype=torch.int, device=hs.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=hs.group("world"))
        for opt in {id(o): o for o in [optimizer, *subs]}.values():
            if getattr(opt, "_has_grad_norm_group_cache", None) is None:
                opt._has_grad_norm_group_cache = {}
            opt._has_grad_norm_group_cache[group] = bool(flag.item())


def _one_param_sync(optimizer, distributed: list) -> None:
    """Megatron's distributed optimizer all-gathers every bucket of the model (dense and expert)
    after each of its sub-optimizers steps, so a rank syncs its parameters once per
    sub-optimizer. HeterMoE ranks of one data-parallel group may hold different numbers of them
    (an Asym-EA attention rank steps a dense and an expert one, another attention rank the dense
    one only): their all-gathers over the attention DP group would not pair up. So the step's
    all-gathers run once, after every sub-optimizer stepped (the same parameters at the end)."""
    step = optimizer.step_with_ready_grads
    chunks = distributed[0].model_chunks

    def stepped() -> bool:
        with distributed_data_parallel.param_sync_deferred(chunks, distributed):
            ok = step()
        for c in chunks:
            c.start_param_sync()
        return ok

    megatron_optimizer.replace_step_with_ready_grads(optimizer, stepped)


@dataclasses.dataclass
class RoleAssembly:
    hs: HeteroParallelState
    pools: PoolPrecision

    def module(self, config, base_spec, seed: int, gpt_kwargs: dict, init_state: dict | None = None,
               vp_stage: int | None = None):
        """The role's module and its canonical parameter names. `config`: model_config's;
        `base_spec`: Megatron's GPT layer spec for the flags, or its decoder block spec (dense and
        MoE layers by --moe-layer-freq; each MoE layer becomes HeteroMoELayer); `gpt_kwargs`:
        GPTModel's arguments beyond config, spec and groups (vocab size, positions, embeddings,
        Megatron's `mtp_block_spec` whose MoE layers become HeteroMoELayer too ...). Built and initialized on the CPU
        (use_cpu_initialization); `init_state`: a plain Megatron state dict (canonical names)
        to start from instead of the layout-invariant values. `vp_stage`: the model chunk of an
        attention rank with virtual pipeline stages (Megatron-LM's get_model builds one per chunk;
        an expert rank, outside Megatron's pipeline, gets one module)."""
        from megatron.core.models.gpt import GPTModel

        from megatron_hetermoe.compat import (
            moe_experts_spec,
            normalize_layer_spec,
        )
        from megatron_hetermoe.models.builder import (
            canonical_names,
            init_layout_invariant,
        )
        from megatron_hetermoe.models.experts import ExpertRuntime
        from megatron_hetermoe.models.moe_layer import (
            hetero_block_spec,
            hetero_mtp_block_spec,
            moe_layer_specs,
        )
        from megatron_hetermoe.plan.layout import load_params
        from megatron_hetermoe.shims.moe_utils import bind_missing_te_general_gemm

        hs = self.hs
        bind_missing_te_general_gemm()  # megatron's router needs it without transformer-engine (shims/moe_utils.py)
        pgc = hs.pg_collection()
        mtp = gpt_kwargs.get("mtp_block_spec")
        P, V = hs.plan.pipeline_stages, hs.plan.virtual_stages
        # Megatron builds the MTP block on the last (virtual) pipeline stage only; an expert rank of
        # a pipelined plan holds its stage's MTP experts in its ExpertRuntime whatever it is given.
        if P == 1 or (hs.role == Role.ATTENTION and hs.stage == P - 1 and vp_stage in (None, V - 1)):
            if (mtp is not None) != bool(hs.plan.mtp_layers):
                raise ValueError(f"the model has {len(mtp.layer_specs) if mtp is not None else 0} MTP layers but the "
                                 f"plan {hs.plan.mtp_layers}; remake the plan for this model's --mtp-num-layers")
        elif hs.role == Role.ATTENTION and mtp is not None:
            raise ValueError(f"pipeline stage {hs.stage} was given the MTP block; Megatron builds it on the last stage")
        if hs.role == Role.ATTENTION:
            if hs.plan.attention_cp > 1:  # megatron-core's local attention has no CP: ours gathers K and V
                from megatron_hetermoe.models.context_attention import context_parallel_spec

                base_spec = context_parallel_spec(base_spec)
            if mtp is not None:
                gpt_kwargs = {**gpt_kwargs, "mtp_block_spec": hetero_mtp_block_spec(mtp, hs, pgc)}
            # This rank's pipeline stage: the embedding on the first, the head and loss on the last.
            P = hs.plan.pipeline_stages
            gpt_kwargs = {"pre_process": hs.stage == 0, "post_process": hs.stage == P - 1, **gpt_kwargs}
            if vp_stage is not None:
                gpt_kwargs = {**gpt_kwargs, "vp_stage": vp_stage}
            module = GPTModel(config=config, transformer_layer_spec=hetero_block_spec(base_spec, hs, pgc, vp_stage),
                              pg_collection=pgc, **gpt_kwargs)
            names = canonical_names(module)
        else:
            module = ExpertRuntime(config, moe_experts_spec(normalize_layer_spec(moe_layer_specs(base_spec)[0])), hs)
            names = module.canonical_names()
        with torch.no_grad():
            if init_state is not None:
                load_params(module, self.local_state(module, init_state, config))
            else:
                init_layout_invariant(module, seed, config, names, tp_group=hs.megatron_group("tp"))
        return module, names

    def local_state(self, module, state: dict, config=None) -> dict:
        """This rank's part of a plain Megatron state dict (canonical names, whole tensors): its
        experts and dense weights (plan.layout.megatron_to_hetero), cut to this rank's
        tensor-parallel shards on a TP attention member."""
        from megatron_hetermoe.plan.layout import megatron_to_hetero

        local = megatron_to_hetero(state, self.hs.plan, self.hs.rank)
        if self.hs.role == Role.ATTENTION and self.hs.plan.attention_tp > 1:
            from megatron_hetermoe.models import tp_shards

            glu = bool(getattr(config if config is not None else module.config, "gated_linear_unit", False))
            local = tp_shards.shard_local_state(module, local, self.hs.megatron_group("tp"), glu)
        return local

    def configure_optimizer(self, optimizer, opt_config):
        """Megatron's optimizer (get_megatron_optimizer's) as a HeterMoE rank steps it:
        - an empty sub-optimizer is dropped (Megatron always adds a dense one; an expert rank has
          no dense parameter, and an empty distributed optimizer cannot write its state);
        - the gradient norm is taken over the world, each gradient counted once (its owner,
          decided per sub-optimizer: dense on attention DP rank 0, experts in ZP group 0; the
          distributed optimizer counts each shard once already), so every rank clips by the one
          global norm and steps in lockstep; its squares summed exactly, so it does not change
          when experts move (world_stats.py world_grad_norm);
        - the distributed optimizer all-gathers the parameters once per step (_one_param_sync);
        - zeros in the gradients (--log-num-zeros-in-grad) are counted like the norm (world_stats.py);
        - with fp16 on a pool, this rank's bf16 sub-optimizers take the world's dynamic scaler,
          and there is one loss scale for the world (training/step.py share_loss_scale).
        Returns the optimizer to step (a new ChainedOptimizer when one was dropped)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        from megatron_hetermoe.training.step import (
            attach_dynamic_scaler,
            share_loss_scale,
        )

        hs = self.hs
        chained = getattr(optimizer, "chained_optimizers", None)
        if chained and any(not o.get_parameters() for o in chained) and any(o.get_parameters() for o in chained):
            optimizer = ChainedOptimizer([o for o in chained if o.get_parameters()])
        if not isinstance(optimizer, ChainedOptimizer):
            raise TypeError(f"HeterMoE steps Megatron's ChainedOptimizer (get_megatron_optimizer's), not "
                            f"{type(optimizer).__name__}")
        for opt in optimizer.chained_optimizers:
            opt.grad_stats_parallel_group = hs.group("world")
        megatron_optimizer.replace_grad_norm(optimizer, world_grad_norm(optimizer, hs))
        distributed = [o for o in optimizer.chained_optimizers if isinstance(o, DistributedOptimizer)]
        if distributed and not distributed[0].ddp_config.overlap_param_gather:
            _one_param_sync(optimizer, distributed)
        if self.pools.dynamic_scale(opt_config.loss_scale) and opt_config.bf16:
            attach_dynamic_scaler(optimizer, opt_config)
        # The grad-stats group is the world (the norm): each sub-optimizer's found_inf check runs
        # over this rank alone, and share_loss_scale ORs the findings over the world once.
        share_loss_scale(optimizer, hs.group("world"), hs.device, check_group=hs.group("self"))
        # --log-num-zeros-in-grad: Megatron's count per sub-optimizer group would count every copy.
        megatron_optimizer.replace_count_zeros(optimizer, world_count_zeros(optimizer, hs))
        _grad_norm_groups_once(optimizer, hs)
        return optimizer

    def schedule(self, run: HeteroRunConfig, recorder=None, executed: list | None = None, task_timing=None):
        """This rank's step function for `run` (schedules/select.py)."""
        from megatron_hetermoe.schedules.select import get_forward_backward_func

        return get_forward_backward_func(self.hs, run, recorder, executed, task_timing)

    def finish_gradients(self, model, num_tokens: torch.Tensor | None = None) -> None:
        """An expert rank's share of Megatron's data-parallel average, after its step: each expert
        saw the tokens of the M attention members of its ZP group, each a local-mean loss (a
        tensor-parallel member's ranks each send their own sequence slice of it) on each of the
        member's CP ranks (each the mean over its own chunks: Megatron averages over dp x cp), so
        Megatron's average needs 1/(M*CP*G); DDP applied 1/G over the replica group. With
        --calculate-per-token-loss (`num_tokens`: the step's tokens over the world) the losses are
        token sums, DDP summed, and Megatron divides every gradient by the step's tokens, as
        finalize_model_grads does on the attention ranks."""
        if self.hs.role != Role.EXPERT:
            return
        from megatron_hetermoe.models.builder import unwrap

        if num_tokens is None:
            scale = 1.0 / (self.hs.num_members_per_group * self.hs.plan.attention_cp)
        elif num_tokens > 0:
            scale = 1.0 / num_tokens
        else:
            return
        for p in unwrap(model).parameters():
            p.main_grad.mul_(scale)
