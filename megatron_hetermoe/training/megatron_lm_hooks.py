"""HeterMoE inside Megatron-LM's own pretrain(): what the patched pretrain_gpt.py hands it.

Every rank, attention and expert alike, runs Megatron-LM's pretrain(): initialize_megatron,
setup_model_and_optimizer, the dataset builders, train() with its timers, rerun state machine,
logging and exit checks, and evaluate(). Every world-wide collective of that loop is therefore
entered by every rank by construction. HeterMoE changes five things, each through a hook that
`HeteroPretrain.installed()` puts in place for the call and takes out after it:

1. validate_args: flags this path cannot honour are refused by name (`refusals`), and Megatron's
   data-parallel size (hence its microbatch calculator) is the plan's attention ranks.
2. Model parallel state: megatron's initialize_model_parallel is replaced by the plan's groups
   (parallel/state.py), installed into megatron-core's parallel_state
   (parallel/megatron_globals.py install_parallel_state).
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
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Callable

import torch
import torch.distributed as dist

from megatron_hetermoe.config import PoolPrecision
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.plan.validation import check_pools

# Megatron-LM flags this path refuses: reason -> {flag: the values it may keep} (Megatron's
# defaults). A flag's argparse dest is its name without dashes.
_OFF, _UNSET, _ONE = (False,), (None,), (1,)
_REFUSED: dict[str, dict[str, tuple]] = {
    "HeterMoE's roles run without model parallelism inside a role": {
        "--tensor-model-parallel-size": _ONE, "--pipeline-model-parallel-size": _ONE,
        "--context-parallel-size": _ONE, "--expert-tensor-parallel-size": (None, 1)},
    "the plan places the experts (hetermoe plan)": {"--expert-model-parallel-size": _ONE},
    "every layer must be an MoE layer (the plan's)": {"--moe-layer-freq": _ONE},
    "HeterMoE builds megatron-core's GPTModel from the command line's flags and Megatron's spec": {
        "--use-legacy-models": _OFF, "--spec": _UNSET, "--yaml-cfg": _UNSET},
    "not supported with HeterMoE": {
        "--mtp-num-layers": _UNSET, "--heterogeneous-layers-config-path": _UNSET,
        "--experimental-attention-variant": _UNSET, "--delay-wgrad-compute": _OFF, "--moe-use-upcycling": _OFF,
        "--use-torch-fsdp2": _OFF, "--use-megatron-fsdp": _OFF, "--calculate-per-token-loss": _OFF},
    "shared experts are not placed by HeterMoE plans": {"--moe-shared-expert-intermediate-size": _UNSET},
    "HeterMoE's dispatcher replaces Megatron's (it drops no tokens and applies the probabilities after combine)": {
        "--moe-expert-capacity-factor": _UNSET, "--moe-permute-fusion": _OFF, "--moe-enable-deepep": _OFF,
        "--moe-apply-probs-on-input": _OFF},
    "zebra is HeterMoE's overlap of expert communication": {"--overlap-moe-expert-parallel-comm": _OFF},
    "not tested with HeterMoE's schedules yet": {"--overlap-grad-reduce": _OFF, "--overlap-param-gather": _OFF},
    "Megatron's recomputation would replay the dispatch collectives that expert ranks do not mirror; "
    "zebra's own recomputation is hetermoe's --recompute": {
        "--recompute-granularity": _UNSET, "--moe-layer-recompute": _OFF},
    "not computed across HeterMoE's roles (the logging rank may hold experts only)": {
        "--log-num-zeros-in-grad": _OFF, "--log-params-norm": _OFF, "--log-max-attention-logit": _OFF,
        "--qk-clip": _OFF},
    "HeterMoE initializes every parameter by Megatron's init method for it, seeded by its name, so every "
    "replica and every layout starts from the same values": {
        "--data-parallel-random-init": _OFF, "--init-model-with-meta-device": _OFF},
    "HeterMoE checkpoints inside pretrain() are Megatron's torch_dist (dist_checkpointing) format": {
        "--ckpt-format": ("torch_dist",)},
    "inside pretrain() dist_checkpointing reshards by itself: load with --no-load-optim --no-load-rng": {
        "--hetero-ckpt-reshard": _OFF},
}
# Flags refused whenever they appear on the command line: their value has no meaning here.
_REFUSED_WHEN_GIVEN = {
    "--moe-token-dispatcher-type": "HeterMoE replaces the token dispatcher with its attention->expert one",
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def refusals(args, argv: list[str]) -> list[str]:
    """Each Megatron-LM flag of this command line that a --hetero-plan run cannot honour, with
    the reason (empty: the run may go on)."""
    out = [f"{flag} {getattr(args, _dest(flag))!r}: {why}" for why, flags in _REFUSED.items()
           for flag, keep in flags.items() if getattr(args, _dest(flag), keep[0]) not in keep]
    if not getattr(args, "num_experts", None):
        out.append("--num-experts: HeterMoE trains MoE models; give --num-experts")
    if getattr(args, "add_bias_linear", False):
        out.append("biased linear layers (Megatron-LM's default): HeterMoE's experts have no bias; pass "
                   "--disable-bias-linear")
    if getattr(args, "moe_grouped_gemm", False) and (args.save or args.load):
        out.append("--moe-grouped-gemm with --save/--load: Megatron-format checkpoints of HeterMoE experts are built "
                   "for SequentialMLP; drop --moe-grouped-gemm")
    given = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    out += [f"{flag}: {why}" for flag, why in _REFUSED_WHEN_GIVEN.items() if flag in given]
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            out.append("--transformer-impl transformer_engine (Megatron-LM's default): transformer-engine is not "
                       "installed; install it or pass --transformer-impl local")
    if not torch.cuda.is_available() and args.distributed_backend != "gloo":
        out.append(f"--distributed-backend {args.distributed_backend!r}: this host has no CUDA; pass "
                   f"--distributed-backend gloo to run the ranks on the CPU")
    return out


@dataclasses.dataclass
class HeteroPretrain:
    """One --hetero-plan run of Megatron-LM's pretrain() on this rank."""
    argv: list[str]
    plan: HeteroPlan | None = None
    schedule: str | None = None
    hs: HeteroParallelState | None = None
    pools: PoolPrecision | None = None
    _fwd_bwd: Callable | None = None

    # ---- 1. arguments ---------------------------------------------------------------------
    def validate_args(self, validate, args, defaults=None):
        bad = refusals(args, self.argv)
        if bad:
            raise SystemExit("--hetero-plan: Megatron-LM flag(s) this run cannot honour:\n  " + "\n  ".join(bad))
        self.plan = HeteroPlan.load(args.hetero_plan)
        world, n_attn = args.world_size, len(self.plan.attention_ranks)
        if self.plan.world_size != world:
            raise PlanError(f"plan {args.hetero_plan} has {self.plan.world_size} ranks but the job has {world}; "
                            f"launch {self.plan.world_size} processes or remake the plan for {world}")
        world_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        self.pools = PoolPrecision(world_precision, getattr(args, "hetero_expert_precision", None) or world_precision)
        check_pools(self.pools, self.plan, f"plan {args.hetero_plan}")
        # Megatron's data parallelism is over the attention ranks: validate_args derives
        # data_parallel_size (and set_global_variables the microbatch calculator) from it.
        args.world_size = n_attn
        try:
            validate(args, defaults or {})
        finally:
            args.world_size = world
        nmb = args.global_batch_size // (args.micro_batch_size * n_attn)
        if nmb != self.plan.num_microbatches:
            raise PlanError(
                f"--global-batch-size {args.global_batch_size} = micro batch {args.micro_batch_size} x {nmb} "
                f"microbatches x {n_attn} attention ranks, but the plan has R={self.plan.num_microbatches}; set "
                f"--global-batch-size {args.micro_batch_size * self.plan.num_microbatches * n_attn} or remake the "
                f"plan with R={nmb}")
        if self.plan.num_layers != args.num_layers or self.plan.num_experts != args.num_experts:
            raise PlanError(f"plan {args.hetero_plan} is for {self.plan.num_layers} layers x {self.plan.num_experts} "
                            f"experts but the flags give --num-layers {args.num_layers} --num-experts "
                            f"{args.num_experts}; remake the plan for this model")
        self.schedule = args.hetero_schedule or self.plan.schedule
        self._pool_args(args)
        if args.rank == 0:
            print(f"> HeterMoE: plan {args.hetero_plan}, {n_attn} attention ranks (Megatron's data parallel size) + "
                  f"{world - n_attn} expert ranks, schedule {self.schedule}, {nmb} microbatches", flush=True)

    def _pool_args(self, args) -> None:
        """Per-pool precision (config.PoolPrecision): this rank's --bf16/--fp16/params_dtype become
        its pool's, so Megatron-LM's own code (its TransformerConfig, get_model's Float16Module,
        its optimizer config) builds this rank in it; each rule Megatron's validate_args ties to
        a precision is applied as it would for that precision: bf16 reduces gradients in fp32, and
        dynamic loss scaling (fp16 on either pool) turns the NaN check off on every rank (an
        overflow is the scaler's signal)."""
        from megatron_hetermoe.models.builder import precision_dtype

        pools = self.pools
        if not pools.mixed:
            return
        if pools.dynamic_scale(args.loss_scale) and args.check_for_nan_in_loss_and_grad:
            args.check_for_nan_in_loss_and_grad = False
        mine = pools.of(self.plan.role(args.rank))
        args.bf16, args.fp16, args.params_dtype = mine == "bf16", mine == "fp16", precision_dtype(mine)
        if mine == "bf16":
            args.accumulate_allreduce_grads_in_fp32 = True
        if args.rank == 0:
            scale = "dynamic" if pools.dynamic_scale(args.loss_scale) else f"constant {args.loss_scale}"
            print(f"> HeterMoE precision: attention ranks {pools.attention}, expert ranks {pools.expert}, tokens "
                  f"cross in {pools.wire}, one {scale} loss scale", flush=True)

    # ---- 2. process groups ----------------------------------------------------------------
    def initialize_distributed(self, initialize, *a, **k):
        """Megatron's _initialize_distributed (torch.distributed, the device), with the plan's
        groups in place of initialize_model_parallel (on CPU ranks the CPU layer makes Megatron
        call it too: _as_if_one_device)."""
        from megatron.core import parallel_state as ps

        original = ps.initialize_model_parallel
        ps.initialize_model_parallel = lambda *x, **y: self._setup_groups()
        try:
            initialize(*a, **k)
        finally:
            ps.initialize_model_parallel = original

    def _setup_groups(self) -> None:
        from megatron.training import get_args

        from megatron_hetermoe.models.builder import precision_dtype
        from megatron_hetermoe.parallel.device import rank_device
        from megatron_hetermoe.parallel.megatron_globals import install_parallel_state
        from megatron_hetermoe.parallel.state import initialize_hetero_parallel

        from megatron_hetermoe.reliability import collective_trace

        collective_trace.install()  # $HETERMOE_TRACE_COLLECTIVES: every collective's order, to check
        timeout = datetime.timedelta(minutes=get_args().distributed_timeout_minutes)
        self.hs = initialize_hetero_parallel(self.plan, timeout=timeout, device=rank_device(),
                                             wire_dtype=precision_dtype(self.pools.wire))
        install_parallel_state(self.hs)
        from megatron_hetermoe.schedules.issuer import resolve_issuer

        experts = {layer: self.hs.local_experts(layer) for layer in range(self.plan.num_layers)}
        issuer = resolve_issuer(get_args().hetero_zebra_issuer, self.hs.device, emulated=False,
                                backend=dist.get_backend(self.hs.dispatch_group))
        print(f"> HeterMoE rank {self.hs.rank} ({self.hs.role}, ZP group {self.hs.group_index}"
              + (f", experts {experts}" if self.hs.role == "expert" else "")
              + (f", zebra issuer {issuer}" if self.schedule == "zebra" else "") + ")", flush=True)

    # ---- 3. the model -----------------------------------------------------------------------
    def builder(self, args, pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None,
                pg_collection=None):
        """A Megatron-LM model builder (gpt_builder's signature): GPTModel with HeteroMoELayer on
        attention ranks, ExpertRuntime on expert ranks, from Megatron's config and layer spec for
        these flags. Every parameter starts at its layout-invariant value (models.builder), so any
        plan, and the plugin's own trainer, start from the same weights."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.training.arguments import core_transformer_config_from_args

        from megatron_hetermoe.compat import bind_missing_te_general_gemm, moe_experts_spec, normalize_layer_spec
        from megatron_hetermoe.models.builder import canonical_names, init_layout_invariant
        from megatron_hetermoe.models.experts import ExpertRuntime
        from megatron_hetermoe.models.moe_layer import hetero_layer_spec

        hs = self.hs
        config = config or core_transformer_config_from_args(args)
        # ep > 1 marks expert weights allreduce=False (Megatron's expert parameters): DDP reduces
        # them over the expert replica group and the optimizer keeps them apart, as in training/hetero.py.
        # No barrier in the model's own L1 timers (Megatron's schedule, finalize_model_grads): the
        # roles run different code there, so a world-wide barrier in one role's never meets the
        # other's (see _no_role_barriers).
        config = dataclasses.replace(config, expert_model_parallel_size=2, barrier_with_L1_time=False)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=args.transformer_impl == "transformer_engine",
                                           normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                           vp_stage=vp_stage)
        # Every layer is MoE (--moe-layer-freq 1, checked); 0.18+ spell its mlp as builders (compat).
        base = normalize_layer_spec(block.layer_specs[0])
        bind_missing_te_general_gemm()  # the router needs it without transformer-engine (compat.py)
        pgc = hs.pg_collection()
        if hs.role == "attention":
            model = GPTModel(
                config=config, transformer_layer_spec=hetero_layer_spec(base, hs, pgc),
                vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                pre_process=pre_process, post_process=post_process,
                fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, pg_collection=pgc,
            )
            names = canonical_names(model)
        else:
            model = ExpertRuntime(config, moe_experts_spec(base), hs)
            names = model.canonical_names()
        with torch.no_grad():
            init_layout_invariant(model, args.seed, config, names)
        return model

    # ---- 4. the schedule --------------------------------------------------------------------
    def get_forward_backward_func(self, *args, **kwargs):
        if self._fwd_bwd is None:
            from megatron.training import get_args

            from megatron_hetermoe.config import ZebraConfig
            from megatron_hetermoe.schedules.select import get_forward_backward_func

            issuer = get_args().hetero_zebra_issuer
            train = get_forward_backward_func(self.hs, self.schedule, zebra_config=ZebraConfig(issuer=issuer))
            evaluate = get_forward_backward_func(self.hs, "distep")
            self._fwd_bwd = lambda **kw: self._step(train, evaluate, **kw)
        return self._fwd_bwd

    def _step(self, train, evaluate, *, forward_only: bool = False, model, **kw):
        from megatron_hetermoe.training.hetero import average_expert_grads

        hs = self.hs
        if forward_only:
            reported = evaluate(forward_only=True, model=model, **kw)
        else:
            reported = train(forward_only=False, model=model, **kw)
            if hs.role == "expert":
                average_expert_grads(hs, model[0] if isinstance(model, list) else model)
        # The world's [token-summed lm loss, tokens]: attention ranks keep their own reports
        # (Megatron sums them over the attention DP group); expert ranks report the world's,
        # divided by their DP (replica) group's size, which Megatron sums over.
        tot = torch.zeros(2, device=hs.device)
        for r in reported or []:
            if "lm loss" in r:
                tot += r["lm loss"].detach().float().view(-1)
        dist.all_reduce(tot, group=hs.world_group)
        if hs.role == "attention":
            return reported
        return [{"lm loss": tot / dist.get_world_size(hs.replica_group)}]

    # ---- 5. the optimizer -------------------------------------------------------------------
    def get_megatron_optimizer(self, build, *a, **k):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        from megatron_hetermoe.checkpoint.megatron_optimizer import per_rank_optimizer_state
        from megatron_hetermoe.training.step import attach_dynamic_scaler, share_loss_scale

        # install_parallel_state makes no gloo twins of the DP groups (only the distributed
        # optimizer's checkpoints use them; on CPU ranks every group is gloo already).
        a, k = _no_role_barriers(a, k)
        optimizer = build(*a, **{**k, "use_gloo_process_groups": False})
        chained = getattr(optimizer, "chained_optimizers", None)
        if chained and any(not o.get_parameters() for o in chained) and any(o.get_parameters() for o in chained):
            # Megatron always adds a dense optimizer; an expert rank has no dense parameter, and an
            # empty distributed optimizer cannot write its state (it asserts one Adam step).
            optimizer = ChainedOptimizer([o for o in chained if o.get_parameters()])
        hs = self.hs
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt.grad_stats_parallel_group = hs.world_group
            # A replica's gradients are counted on its owner only, decided per sub-optimizer (an
            # Asym-EA attention rank steps a dense one and an expert one, owned apart). The
            # distributed optimizer already counts each shard once: dense ones over the attention
            # DP group, experts over their replica group.
            if not isinstance(opt, DistributedOptimizer) and not hs.owns_gradient(_holds_experts(opt)):
                opt.get_main_grads_for_grad_norm = list
            if isinstance(opt, DistributedOptimizer):
                # Its checkpoint keys name the model-parallel group the state belongs to; here the
                # attention DP group (dense) or the replica group of one ZP member position (experts).
                opt.data_parallel_group_idx = 0 if opt.data_parallel_group is hs.attention_dp_group \
                    else 1 + hs.member_index
        # Per-pool precision with fp16 on a pool: this rank's bf16 sub-optimizers scale too.
        config = a[0] if a else k["config"]
        if self.pools.dynamic_scale(config.loss_scale) and config.bf16:
            attach_dynamic_scaler(optimizer, config)
        # --fp16 / --bf16 with a loss scale: one scale for the world, found_inf ORed over it once.
        share_loss_scale(optimizer, hs.world_group, hs.device, check_group=hs.self_group)
        per_rank_optimizer_state(optimizer, hs.rank, dist.get_world_size())
        return optimizer

    # ---- 6. checkpoints: the RNG states, one shard per rank ------------------------------------
    def get_rng_state(self, get, ckpt_format, *a, **k):
        """Megatron shards its RNG-state object by (PP, TP, DP) rank, and an attention rank and an
        expert rank share DP rank 0 here: one shard per rank of the world instead."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        state = get(ckpt_format, *a, **k)
        if not isinstance(state, ShardedObject):
            return state
        return ShardedObject("rng_state", state.data, (1, 1, dist.get_world_size()), (0, 0, dist.get_rank()),
                             replica_id=0)

    # ---- 7. MoE metrics: the routers are on attention ranks ------------------------------------
    def reduce_aux_losses(self, reduce, track_names=None, pg_collection=None):
        """Megatron reduces its per-layer MoE losses (load balancing, z-loss) per rank's groups;
        expert ranks hold no router, so theirs stay zero, and the last rank, which logs them, may
        be an expert rank: every rank gets the first attention rank's values."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        reduce(track_names, pg_collection=pg_collection)
        if track_names is None:  # names may differ between roles; Megatron's training_log gives them
            return
        tracker = get_moe_layer_wise_logging_tracker()
        for name in track_names:
            dist.broadcast(tracker[name]["values"], src=self.plan.attention_ranks[0], group=self.hs.world_group)

    # ---- the hooks, in place for one pretrain() call ------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.training.checkpointing as checkpointing
        import megatron.training.initialize as initialize
        import megatron.training.training as training

        with contextlib.ExitStack() as stack:
            if not torch.cuda.is_available():
                stack.enter_context(_replaced(_cpu_replacements()))
            # Read after the CPU layer is in: these wrap it.
            stack.enter_context(_replaced([
                (initialize, "validate_args", _wrap(initialize.validate_args, self.validate_args)),
                (initialize, "_initialize_distributed",
                 _wrap(initialize._initialize_distributed, self.initialize_distributed)),
                (training, "get_forward_backward_func", self.get_forward_backward_func),
                (training, "get_megatron_optimizer",
                 _wrap(training.get_megatron_optimizer, self.get_megatron_optimizer)),
                (checkpointing, "get_rng_state", _wrap(checkpointing.get_rng_state, self.get_rng_state)),
                (moe_utils, "reduce_aux_losses_tracker_across_ranks",
                 _wrap(moe_utils.reduce_aux_losses_tracker_across_ranks, self.reduce_aux_losses)),
                (checkpointing, "FullyParallelSaveStrategyWrapper", _save_wrapper_for_roles()),
            ]))
            yield self


def _no_role_barriers(a: tuple, k: dict) -> tuple[tuple, dict]:
    """get_megatron_optimizer's arguments with its OptimizerConfig's barrier_with_L1_time off.

    --barrier-with-L1-time (Megatron's default) makes every L1 timer barrier over the world when
    it starts and stops. Megatron-LM's loop-level timers (forward-backward-and-optimizer pieces
    train_step times itself) run on every rank alike and keep their barriers. The timers inside
    the optimizer run once per sub-optimizer, and HeterMoE ranks hold different numbers of them
    (dense only, dense + Asym-EA experts, experts only): their world barriers would pair up
    wrongly and hang. Those, and the model's (builder), time without a barrier: each rank's own
    time, which --timing-log-option all shows per rank."""
    if a:
        return (dataclasses.replace(a[0], barrier_with_L1_time=False), *a[1:]), k
    return a, {**k, "config": dataclasses.replace(k["config"], barrier_with_L1_time=False)}


def _save_wrapper_for_roles():
    """megatron-core's FullyParallelSaveStrategyWrapper for ranks whose save groups differ in size
    by role (Megatron-LM saves over each rank's data-parallel group: an attention rank's is the
    attention DP group, an expert rank's its replica group, often of one rank).

    With --ckpt-assume-constant-structure the wrapper caches its save distribution after the first
    save and from then on skips the sharding validation, a world-wide all_gather_object. For a
    one-rank group it computes no distribution, so it caches nothing and validated again at every
    save: those ranks entered the world-wide gather while the others had moved on to the save's
    own collectives, and the second save hung. Here a one-rank group caches that it has nothing to
    distribute, so every rank validates at the first save only, as with equal groups."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    class SaveParallelizationForRoles(FullyParallelSaveStrategyWrapper):
        def apply_saving_parallelization(self, sharded_state_dict) -> None:
            super().apply_saving_parallelization(sharded_state_dict)
            if (self.do_cache_distribution and self.cached_distribution is None
                    and dist.get_world_size(self.parallelization_group) <= 1):
                # Never read for a one-rank group (the distribution is applied only to larger ones).
                self.cached_distribution = _NOTHING_TO_DISTRIBUTE

    return SaveParallelizationForRoles


_NOTHING_TO_DISTRIBUTE = ()


def _holds_experts(optimizer) -> bool:
    """Whether a Megatron sub-optimizer steps expert parameters: Megatron's factory keeps dense and
    expert parameters (allreduce=False) in separate sub-optimizers and marks each param group's
    is_expert_parallel (its main-parameter copies in 16-bit carry no allreduce attribute)."""
    expert = {bool(g.get("is_expert_parallel", False)) for g in optimizer.param_groups}
    if len(expert) > 1:
        raise RuntimeError("a Megatron sub-optimizer holds both dense and expert parameters; HeterMoE counts "
                           "each sub-optimizer's gradients in the global norm on one owner")
    return expert == {True}


def _wrap(original: Callable, hook: Callable) -> Callable:
    return lambda *a, **k: hook(original, *a, **k)


@contextlib.contextmanager
def _replaced(replacements: list):
    """Set each (module, name, value) for the block, then put the originals back."""
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in replacements]
    for mod, name, new in replacements:
        setattr(mod, name, new)
    try:
        yield
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


def _cpu_replacements() -> list:
    """Megatron-LM's pretrain() on CPU ranks over gloo, HeterMoE or not. Megatron asserts CUDA
    unless told the run may go without, builds legacy CUDA kernels with nvcc, and initializes
    model parallelism and its RNG tracker only when CUDA devices exist; the CPU backend
    (parallel/cpu_backend.py) stands in for CUDA, and these let Megatron's own code do the rest."""
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    from megatron_hetermoe.compat import bind_missing_te_general_gemm
    from megatron_hetermoe.parallel import cpu_backend

    cpu_backend.apply()
    bind_missing_te_general_gemm()  # megatron's router needs it without transformer-engine (compat.py)
    init = training.initialize_megatron
    return [
        (training, "initialize_megatron", lambda *a, **k: init(*a, allow_no_cuda=True, **k)),
        (fused_kernels, "load", lambda args: None),
        # It calls Megatron's fused kernels only to have torch.compile build them ahead (inductor's
        # C++ on CPU ranks, seconds each); an enabled fusion still builds on first use.
        (initialize, "_warmup_jit_function", lambda: None),
        (initialize, "_initialize_distributed", _wrap(initialize._initialize_distributed, _as_if_one_device)),
        (initialize, "_set_random_seed", _wrap(initialize._set_random_seed, _seed_cpu_rng_tracker)),
    ]


def _as_if_one_device(initialize_distributed, *a, **k) -> None:
    """Megatron's _initialize_distributed calls initialize_model_parallel only when
    torch.cuda.device_count() > 0; the CPU backend's device is the CPU (set_device is a no-op)."""
    count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        initialize_distributed(*a, **k)
    finally:
        torch.cuda.device_count = count


def _seed_cpu_rng_tracker(set_random_seed, seed_: int, data_parallel_random_init: bool = False, *a, **k) -> None:
    """Megatron seeds its model-parallel RNG tracker only when CUDA devices exist; on CPU ranks
    the CPU backend's tracker gets the seed Megatron's _set_random_seed would give it."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    set_random_seed(seed_, data_parallel_random_init, *a, **k)
    seed = seed_ + 100 * ps.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * ps.get_data_parallel_rank()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_on_cpu(pretrain: Callable) -> Callable:
    """Megatron-LM's pretrain() with the CPU layer (_cpu_replacements) in place on a host
    without CUDA; unchanged where CUDA exists. Lets a plain Megatron EP run share the CPU tests'
    machine (its checkpoints load into HeterMoE runs and back)."""
    if torch.cuda.is_available():
        return pretrain

    def on_cpu(*a, **k):
        with _replaced(_cpu_replacements()):
            return pretrain(*a, **k)

    return on_cpu


def hetero_pretrain(pretrain: Callable, argv: list[str]) -> tuple[Callable, Callable]:
    """(pretrain with HeterMoE's hooks in place, the model builder to give model_provider)."""
    run = HeteroPretrain(list(argv))

    def hetero(*a, **k):
        with run.installed():
            return pretrain(*a, **k)

    return hetero, run.builder
