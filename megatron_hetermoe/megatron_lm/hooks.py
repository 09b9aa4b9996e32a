"""HeterMoE inside Megatron-LM's own pretrain(): the hooks `HeteroPretrain.installed()` puts in place
for one call (package docstring: what each changes)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
from typing import Callable

import torch
import torch.distributed as dist

from megatron_hetermoe.config import PoolPrecision
from megatron_hetermoe.megatron_lm.cpu_layer import cpu_layer
from megatron_hetermoe.megatron_lm.refusals import refusals, schedule_refusals
from megatron_hetermoe.megatron_lm.replaced import (
    given_flags,
    recompute_choice,
    replace_flags,
)
from megatron_hetermoe.models.builder import KernelChoice, RankEnv
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.shims import distrib_optimizer, megatron_training, parallel_state, torch_distributed
from megatron_hetermoe.training.assembly import RoleAssembly
from megatron_hetermoe.training.expert_move import rebuild_config
from megatron_hetermoe.training.validation import (
    check_hetero_pp,
    check_hetero_split,
    check_hetero_tp,
    check_hetero_virtual_stages,
    check_plan_for_job,
)
from megatron_hetermoe.vocabulary import Role, ScheduleName


@dataclasses.dataclass
class HeteroPretrain:
    """One --hetero-plan run of Megatron-LM's pretrain() on this rank."""
    argv: list[str]
    plan: HeteroPlan | None = None
    schedule: str | None = None
    recompute: bool = False  # zebra recomputes its attention stages (--recompute-granularity full)
    hs: HeteroParallelState | None = None
    pools: PoolPrecision | None = None
    assembly: RoleAssembly | None = None
    envs: list[RankEnv] | None = None  # every rank's, gathered at group set-up
    kernels: dict[str, KernelChoice] | None = None  # each pool's (role's)
    _fwd_bwd: Callable | None = None
    loads: object | None = None  # training/expert_load_log.ExpertLoadLog, made with the groups
    _fusions_told: bool = False
    reshard: bool = False  # the checkpoint to load was saved on another plan (checkpoints.py)
    # --hetero-replan-interval (live_moves.py): what a live move builds again with
    names: dict[str, str] | None = None  # the builder's canonical parameter names (its last module's)
    schedules: tuple | None = None  # (training, evaluation) step functions for the plan
    recorder: object | None = None  # the schedule's TimelineRecorder (task seconds for the loads)
    moves: object | None = None  # live_moves.PretrainMoves
    _model_call: tuple | None = None  # (get_model, args, kwargs) as pretrain() called it
    _optimizer_call: tuple | None = None  # (get_megatron_optimizer, args, kwargs) ...
    _init_state: dict | None = None  # the builder's parameters (canonical names) during a rebuild
    _counted: int | None = None  # the last iteration whose task seconds the expert-load log took

    # ---- 1. arguments ---------------------------------------------------------------------
    def validate_args(self, validate, args, defaults=None):
        bad = refusals(args)
        if bad:
            raise SystemExit("--hetero-plan: Megatron-LM flag(s) this run cannot honour:\n  " + "\n  ".join(bad))
        if args.hetero_plan == "auto":
            from megatron_hetermoe.megatron_lm.auto_plan import plan_for_job

            with _one_line_errors():
                self.plan = plan_for_job(args, self.argv)
        else:
            self.plan = HeteroPlan.load(args.hetero_plan)
        self.schedule = args.hetero_schedule or self.plan.schedule
        self.recompute, recompute_notes, bad = recompute_choice(args, self.schedule)
        bad += schedule_refusals(args, self.schedule)
        from megatron_hetermoe.megatron_lm.live_moves import replan_refusals

        bad += replan_refusals(args, self.plan)
        if bad:
            raise SystemExit("--hetero-plan: Megatron-LM flag(s) this run cannot honour:\n  " + "\n  ".join(bad))
        notes = replace_flags(args, self.argv, self.plan) + recompute_notes
        if args.rank == 0:
            for note in notes:
                print(f"> HeterMoE: {note}", flush=True)
        world, n_attn = args.world_size, len(self.plan.attention_ranks)
        world_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        self.pools = PoolPrecision(world_precision, getattr(args, "hetero_expert_precision", None) or world_precision)
        freq = args.moe_layer_freq
        check_plan_for_job(self.plan, world, args.num_layers, args.num_experts, args.micro_batch_size,
                           args.global_batch_size, self.pools, f"--num-layers {args.num_layers} --num-experts "
                           f"{args.num_experts}" + (f" --moe-layer-freq {freq}" if freq != 1 else ""),
                           "remake the plan for this model", f"plan {args.hetero_plan}", moe_layer_freq=freq,
                           mtp_num_layers=args.mtp_num_layers)
        # --expert-tensor-parallel-size was replaced by the plan's whole experts (replace_flags).
        check_hetero_tp(self.plan, args.tensor_model_parallel_size, args.sequence_parallel,
                        args.expert_tensor_parallel_size, args.context_parallel_size)
        check_hetero_pp(self.plan, args.pipeline_model_parallel_size, self.schedule)
        check_hetero_split(self.plan, getattr(args, "decoder_first_pipeline_num_layers", None),
                           getattr(args, "decoder_last_pipeline_num_layers", None))
        # Megatron's data parallelism is over the attention ranks: validate_args derives
        # data_parallel_size (and set_global_variables the microbatch calculator) from it.
        args.world_size = n_attn
        try:
            validate(args, defaults or {})
        finally:
            args.world_size = world
        from megatron_hetermoe.megatron_lm.checkpoints import PLAN_ARG, resume_plan

        with _one_line_errors():
            self.reshard = resume_plan(args, self.plan)
        setattr(args, PLAN_ARG, self.plan.to_json())  # saved with the flags in every checkpoint
        # Megatron's validate_args derives the virtual pipeline size from either of its flags.
        check_hetero_virtual_stages(self.plan, getattr(args, "virtual_pipeline_model_parallel_size", None),
                                    self.schedule)
        nmb = self.plan.num_microbatches
        self._pool_args(args)
        if getattr(args, "hetero_replan_interval", 0):
            from megatron_hetermoe.megatron_lm.live_moves import PretrainMoves
            from megatron_hetermoe.training.hetero_args import hetero_run_config

            try:
                run = hetero_run_config(args, recompute=self.recompute)
            except ValueError as e:
                raise SystemExit(f"--hetero-plan: {e}") from None
            self.moves = PretrainMoves(self, dataclasses.replace(run, schedule=self.schedule))
        if args.rank == 0:
            tp, pp, cp = self.plan.attention_tp, self.plan.pipeline_stages, self.plan.attention_cp
            dp = self.plan.num_attention_members
            attn = (f"{n_attn} attention ranks (Megatron's data parallel size)" if tp == pp == cp == 1 else
                    f"{n_attn} attention ranks ({dp} member{'s' if dp != 1 else ''}"
                    + (f" of tensor parallel size {tp}" if tp > 1 else "")
                    + (f" {'and' if tp > 1 else 'of'} context parallel size {cp}" if cp > 1 else "")
                    + (f" in each of {pp} pipeline stages" if pp > 1 else "")
                    + f": Megatron's data parallel size {dp})")
            print(f"> HeterMoE: plan {args.hetero_plan}, {attn} + {world - n_attn} expert ranks, schedule "
                  f"{self.schedule}, {nmb} microbatches", flush=True)

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
        call it too: shims/megatron_training.py _as_if_one_device)."""
        with parallel_state.initialize_model_parallel_replaced(self._setup_groups):
            initialize(*a, **k)

    def _setup_groups(self) -> None:
        from megatron.training import get_args

        from megatron_hetermoe.models.builder import precision_dtype
        from megatron_hetermoe.parallel.device import rank_device
        from megatron_hetermoe.parallel.megatron_globals import install_parallel_state
        from megatron_hetermoe.parallel.state import initialize_hetero_parallel

        torch_distributed.trace_collectives()  # $HETERMOE_TRACE_COLLECTIVES: every collective's order, to check
        timeout = datetime.timedelta(minutes=get_args().distributed_timeout_minutes)
        self.hs = initialize_hetero_parallel(self.plan, timeout=timeout, device=rank_device(),
                                             wire_dtype=precision_dtype(self.pools.wire))
        install_parallel_state(self.hs)
        parallel_state.alias_gtp_remat_groups()
        self.assembly = RoleAssembly(self.hs, self.pools)
        from megatron_hetermoe.training.expert_load_log import ExpertLoadLog

        # Tokens only: Megatron's schedule and these task lists record no task times here.
        self.loads = ExpertLoadLog(self.hs, [self.plan.role(r) for r in range(self.plan.world_size)],
                                   getattr(get_args(), "hetero_expert_load_stats", None), None,
                                   writes=dist.get_rank() == 0)
        self._choose_kernels(get_args())
        from megatron_hetermoe.schedules.issuer import resolve_issuer

        experts = {self.plan.moe_layer_ids[layer]: self.hs.local_experts(layer)
                   for layer in range(self.plan.num_layers)}
        issuer = resolve_issuer(get_args().hetero_zebra_issuer, self.hs.device, emulated=False,
                                backend=self.hs.transport.backend)
        print(f"> HeterMoE rank {self.hs.rank} ({self.hs.role}, ZP group {self.hs.group_index}"
              + (f", experts {experts}" if self.hs.role == Role.EXPERT else "")
              + (f", zebra issuer {issuer}" if self.schedule == ScheduleName.ZEBRA else "") + ")", flush=True)

    def _choose_kernels(self, args) -> None:
        """Each pool's kernels from every rank's GPU (models.builder.megatron_lm_kernels: the
        ranks of a pool share gradient reductions, so they run one choice), computed alike on
        every rank so that a request some rank cannot run fails everywhere before any model is
        built; the first rank prints them on CUDA ranks."""
        from megatron_hetermoe.models.builder import gather_rank_envs, megatron_lm_kernels

        self.envs = gather_rank_envs(self.hs.device, self.hs.group("world"))
        given = "--transformer-impl" in given_flags(self.argv)
        self.kernels = {role: megatron_lm_kernels(args.transformer_impl, given, bool(args.moe_grouped_gemm),
                                                  self.pools.of(role), [self.envs[r] for r in ranks])
                        for role, ranks in (("attention", self.plan.attention_ranks),
                                            ("expert", self.plan.expert_ranks)) if ranks}
        if self.hs.rank == 0 and self.hs.device.type == "cuda":
            for role, choice in self.kernels.items():
                print(f"> HeterMoE {role} ranks: {choice.line()}", flush=True)

    def _rank_config(self, args, config):
        """This rank's TransformerConfig: its pool's kernels where Megatron-LM's default
        transformer_engine cannot run there, and Megatron's fusions (its flags) less those this rank
        cannot run (models.builder.choose_fusions; the first rank of each pool says which and why)."""
        from megatron_hetermoe.models.builder import Fusion, choose_fusions

        hs = self.hs
        choice = self.kernels[hs.role]
        over = {}
        if args.transformer_impl == "transformer_engine" and choice.transformer_impl != "transformer_engine":
            over = {"transformer_impl": choice.transformer_impl, "moe_grouped_gemm": choice.moe_grouped_gemm}
        fusions = choose_fusions(self.envs[hs.rank], choice.name, hs.role, args.normalization,
                                 {f: bool(getattr(config, f.value)) for f in Fusion})
        first = hs.rank == (self.plan.attention_ranks if hs.role == Role.ATTENTION else self.plan.expert_ranks)[0]
        if first and not self._fusions_told:
            for line in fusions.lines():
                print(f"> HeterMoE rank {hs.rank} ({hs.role} ranks' first): {line}", flush=True)
        self._fusions_told = True
        return {**over, **fusions.config_kwargs()}

    # ---- 3. the model -----------------------------------------------------------------------
    def builder(self, args, pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None,
                pg_collection=None):
        """A Megatron-LM model builder (gpt_builder's signature): the role's module
        (RoleAssembly.module) from Megatron's config and layer spec for these flags. Every
        parameter starts at its layout-invariant value, so any plan, and the plugin's own trainer,
        start from the same weights."""
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_mtp_block_spec,
        )
        from megatron.training.arguments import core_transformer_config_from_args

        from megatron_hetermoe.training.assembly import model_config

        # No barrier in the model's own L1 timers (Megatron's schedule, finalize_model_grads): the
        # roles run different code there, so a world-wide barrier in one role's never meets the
        # other's (see _no_role_barriers).
        from megatron_hetermoe.parallel import cpu_backend

        config = config or core_transformer_config_from_args(args)
        config = model_config(config, self.hs, barrier_with_L1_time=False, **self._rank_config(args, config))
        use_te = config.transformer_impl == "transformer_engine"
        # TP > 1 with megatron-core's local spec: its torch norms under sequence parallelism, on GPUs too.
        cpu_backend.apply_for_spec(self.hs.device, config.transformer_impl)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                           qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
        # The block spec: dense and MoE layers by --moe-layer-freq (the plan's dense_layers, checked).
        gpt = dict(vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                   pre_process=pre_process, post_process=post_process,
                   fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                   rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling)
        if args.mtp_num_layers:
            # As Megatron-LM's gpt_builder: the MTP layers take the decoder's last layer spec
            # (RoleAssembly.module puts HeteroMoELayer in it).
            gpt["mtp_block_spec"] = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=use_te,
                                                           vp_stage=vp_stage)
        if self._init_state is not None:  # a live move: every parameter comes from the moved states
            config = rebuild_config(config)
        module, self.names = self.assembly.module(config, block, args.seed, gpt, self._init_state, vp_stage=vp_stage)
        return module

    def get_model(self, get, *a, **k):
        self._model_call = (get, a, k)
        return get(*a, **k)

    def rebuild_model(self, init_state: dict) -> list:
        """The model chunks as pretrain() built them (its get_model call), with `init_state`'s
        parameters, for hs's plan (a live move: live_moves.py)."""
        get, a, k = self._model_call
        self._init_state = init_state
        try:
            return get(*a, **k)
        finally:
            self._init_state = None

    def rebuild_optimizer(self, chunks: list):
        """Megatron's optimizer for `chunks`, as pretrain() built it (its get_megatron_optimizer call)."""
        build, a, k = self._optimizer_call
        if len(a) > 1:
            a = (a[0], chunks, *a[2:])
        else:
            k = {**k, "model_chunks": chunks}
        return self.get_megatron_optimizer(build, *a, **k)

    def rebuild_schedules(self):
        """The step functions for hs's plan (a live move); returns the training one."""
        self.schedules = None
        self.get_forward_backward_func()
        return self.schedules[0]

    # ---- 4. the schedule --------------------------------------------------------------------
    def get_forward_backward_func(self, *args, **kwargs):
        if self.schedules is None:
            from megatron.training import get_args

            from megatron_hetermoe.schedules.timeline import TimelineRecorder
            from megatron_hetermoe.training.hetero_args import hetero_run_config

            run = dataclasses.replace(hetero_run_config(get_args(), recompute=self.recompute), schedule=self.schedule)
            if self.recorder is None:  # each step's compute seconds per task kind, for the expert loads
                self.recorder = TimelineRecorder(self.hs.rank, self.hs.role, keep_history=False)
                self.loads.recorder = self.recorder
            self.schedules = (self.assembly.schedule(run, self.recorder),
                              # forward-only passes
                              self.assembly.schedule(dataclasses.replace(run, schedule="distep")))
        if self._fwd_bwd is None:
            self._fwd_bwd = lambda **kw: self._step(**kw)
        return self._fwd_bwd

    def _step(self, *, forward_only: bool = False, model, **kw):
        hs = self.hs
        train, evaluate = self.schedules
        if forward_only:
            hs.load_meter.enabled = False  # an evaluation's routes are no training load
            try:
                reported = evaluate(forward_only=True, model=model, **kw)
            finally:
                hs.load_meter.enabled = True
        else:
            from megatron.training import get_args

            self.recorder.step = get_args().curr_iteration  # 0-based: the expert-load log reads iteration - 1
            reported = train(forward_only=False, model=model, **kw)
        # The world's [token-summed lm loss, tokens]: attention ranks keep their own reports
        # (Megatron sums them over the attention DP group); expert ranks report the world's,
        # divided by their DP (replica) group's size, which Megatron sums over.
        tot = torch.zeros(2, device=hs.device)
        for r in reported or []:
            if "lm loss" in r:
                tot += r["lm loss"].detach().float().view(-1)
        dist.all_reduce(tot, group=hs.group("world"))
        if not forward_only:
            # --calculate-per-token-loss: the step's tokens (the loss mask's, which lm loss counts).
            from megatron.core.utils import get_model_config

            chunk = model[0] if isinstance(model, list) else model
            per_token = get_model_config(chunk).calculate_per_token_loss
            self.assembly.finish_gradients(chunk, tot[1] if per_token else None)
        if hs.role == Role.ATTENTION:
            return reported
        return [{"lm loss": tot / dist.get_world_size(hs.group("replica"))}]

    def data_iterators(self, build, provider):
        """Megatron-LM's build_train_valid_test_data_iterators, which pretrain() calls once per
        model chunk (each call has world-wide barriers and a broadcast): with virtual stages an
        attention rank has one chunk per virtual stage, an expert rank one module for all of its
        stage's chunks, so an expert rank builds as many times (it reads no data: the first
        result is kept)."""
        V = self.plan.virtual_stages
        if self.hs.role != Role.EXPERT or V == 1:
            return build(provider)
        return [build(provider) for _ in range(V)][0]

    # ---- 5. the optimizer -------------------------------------------------------------------
    def get_megatron_optimizer(self, build, *a, **k):
        from megatron_hetermoe.checkpoint.megatron_optimizer import (
            per_rank_optimizer_state,
        )

        # install_parallel_state makes no gloo twins of the DP groups (only the distributed
        # optimizer's checkpoints use them; on CPU ranks every group is gloo already).
        a, k = _no_role_barriers(a, k)
        self._optimizer_call = (build, a, k)
        optimizer = build(*a, **{**k, "use_gloo_process_groups": False})
        hs = self.hs
        optimizer = self.assembly.configure_optimizer(optimizer, a[0] if a else k["config"])
        # Its checkpoint keys: each data-parallel group named once in the job (name_dp_groups there).
        per_rank_optimizer_state(optimizer, hs.rank, dist.get_world_size(), reshard=self.reshard)
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
        from megatron.core.transformer.moe.moe_utils import (
            get_moe_layer_wise_logging_tracker,
        )

        reduce(track_names, pg_collection=pg_collection)
        if track_names is None:  # names may differ between roles; Megatron's training_log gives them
            return
        tracker = get_moe_layer_wise_logging_tracker()
        for name in track_names:
            tracker[name]["values"] = self._first_attention_ranks(tracker[name]["values"])

    def sync_moe_metrics(self, sync, tracker, metric_names, pg_collection=None):
        """core_v0.19.0's form of reduce_aux_losses: training_log's get_moe_metrics_tracker().report()
        syncs the per-layer values in MoEMetricsTracker._sync_metrics (every track name exists on
        every rank: report(force_initialize=True))."""
        sync(tracker, metric_names, pg_collection)
        for name in metric_names:
            entry = tracker.metrics.get(name)
            if entry is not None:
                entry.values = self._first_attention_ranks(entry.values)

    def track_moe_metrics(self, track, *a, **k):
        """Megatron-LM's MoE metrics, then the expert loads (training/expert_load_log.py): training_log
        calls it on every rank at every iteration; at each log interval one all-reduce, the
        stats file, the writers' scalars and "expert load max/mean" in the iteration line."""
        from megatron.training import get_args

        track(*a, **k)
        iteration = k["iteration"] if "iteration" in k else a[1]
        self.loads.step(iteration)
        self._counted = iteration
        args = get_args()
        if iteration % args.log_interval:
            return
        load = self.loads.interval(iteration)
        self.loads.write_scalars(load, iteration, k.get("writer"), k.get("wandb_writer"),
                                 bool(k.get("per_layer_logging")))
        total = k.get("total_loss_dict")
        if total is not None:
            self.loads.total_loss_entry(load, total, int(total.get("advanced iterations", 1)))

    def _first_attention_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if values.numel() != self.plan.model_layers:
            # Megatron sizes an untouched tracker by --num-layers, the routers by their layers
            # with the MTP layers; only the first attention rank's values are kept.
            values = values.new_zeros(self.plan.model_layers)
        dist.broadcast(values, src=self.plan.attention_ranks[0], group=self.hs.group("world"))
        return values

    def reduce_mtp_losses(self, reduce):
        """Megatron averages the MTP losses over each rank's data-parallel group (the attention
        ranks: the MTP block is theirs, on the last pipeline stage) and the last rank logs them,
        which may be an expert rank or another stage's rank, with no MTP loss: every rank gets the
        values of the first attention rank of the last stage."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        from megatron_hetermoe.compat import megatron_lm_mtp_reduce

        reduce()
        tracker = MTPLossLoggingHelper.tracker
        _, keys = megatron_lm_mtp_reduce()  # the tracker keys Megatron reduced: the release's
        for key in keys:
            if key not in tracker:  # an expert rank: no MTP layer ran here
                tracker[key] = torch.zeros(self.plan.mtp_layers, device=self.hs.device)
            last = self.plan.stage_attention_ranks(self.plan.pipeline_stages - 1)[0]
            dist.broadcast(tracker[key], src=last, group=self.hs.group("world"))

    # ---- 8. the end of each step: live moves (--hetero-replan-interval) -------------------------
    def post_training_step(self, callbacks, model, optimizer, opt_param_scheduler, iteration, *a, **k):
        """Megatron-LM's post-step callbacks, then (every rank) the expert-load log's step where
        training_log did not count it (core_v0.19.0 has no track_moe_metrics to hook) and the live
        moves' decision."""
        out = callbacks(model, optimizer, opt_param_scheduler, iteration, *a, **k)
        if self._counted != iteration:
            self.loads.step(iteration)
            self._counted = iteration
        if self.moves is not None:
            self.moves.after_step(model, optimizer, opt_param_scheduler, iteration)
        return out

    # ---- 9. --log-params-norm: each parameter once over the world ---------------------------------
    def params_norm(self, model, force_create_fp32_copy: bool = False) -> float:
        """Megatron's calc_params_l2_norm sums each rank's dense parameters over its model-parallel
        group and its experts over its expert group; on a HeterMoE world those hold other copies
        (world_stats.py)."""
        from megatron.training import get_args

        from megatron_hetermoe.training.world_stats import params_l2_norm

        chunks = model if isinstance(model, list) else [model]
        return params_l2_norm(chunks, self.hs, use_main_params=get_args().bf16 and not force_create_fp32_copy)

    # ---- the hooks, in place for one pretrain() call ------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        """The hooks for one pretrain() call. Where pretrain_gpt.py parses and validates the flags
        before pretrain() (core_v0.19.0), validate_args' hook is `parsing`'s instead."""
        with contextlib.ExitStack() as stack:
            if not torch.cuda.is_available():
                stack.enter_context(cpu_layer())
            else:  # a GPU rank without apex or transformer-engine runs torch's Adam too
                stack.enter_context(distrib_optimizer.torch_adam_state_dict())
            # Entered after the CPU layer: these wrap it.
            stack.enter_context(megatron_training.pretrain_hooks(megatron_training.PretrainHooks(
                initialize_distributed=self.initialize_distributed,
                get_forward_backward_func=self.get_forward_backward_func,
                get_megatron_optimizer=self.get_megatron_optimizer,
                get_rng_state=self.get_rng_state,
                save_strategy_wrapper=_save_wrapper_for_roles(),
                calc_params_l2_norm=self.params_norm,
                data_iterators=self.data_iterators,
                validate_args=self.validate_args,
                track_moe_metrics=self.track_moe_metrics,
                reduce_aux_losses=self.reduce_aux_losses,
                sync_moe_metrics=self.sync_moe_metrics,
                reduce_mtp_losses=self.reduce_mtp_losses,
                get_model=self.get_model,
                post_training_step=self.post_training_step,
            )))
            yield self

    @contextlib.contextmanager
    def parsing(self):
        """core_v0.19.0: pretrain_gpt.py parses and validates the flags before pretrain()
        (arguments.parse_and_validate_args): validate_args' hook, for that call."""
        with megatron_training.validate_args_hook(self.validate_args, cpu=not torch.cuda.is_available()):
            yield self

    def pretrain(self, pretrain: Callable, *a, **k):
        """Megatron-LM's pretrain() with the hooks in place. core_v0.19.0's takes a config
        container first, whose model (a GPTModelConfig) Megatron would build itself: without it,
        Megatron builds the model with model_provider (pretrain_gpt.py passes its model_provider
        with this run's builder), as core_v0.16.1 always does."""
        if a and getattr(a[0], "model", None) is not None and k.get("model_provider") is not None:
            cfg = copy.copy(a[0])
            cfg.model = None
            a = (cfg, *a[1:])
        with self.installed():
            return pretrain(*a, **k)


@contextlib.contextmanager
def _one_line_errors():
    """A user's error (a bad inventory, a checkpoint that cannot load here) ends the rank with its
    message, as the refusals do, not a traceback."""
    from megatron_hetermoe.errors import UserError

    try:
        yield
    except UserError as e:
        raise SystemExit(f"--hetero-plan: {e}") from None


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
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    class SaveParallelizationForRoles(FullyParallelSaveStrategyWrapper):
        def apply_saving_parallelization(self, sharded_state_dict) -> None:
            super().apply_saving_parallelization(sharded_state_dict)
            if (self.do_cache_distribution and self.cached_distribution is None
                    and dist.get_world_size(self.parallelization_group) <= 1):
                # Never read for a one-rank group (the distribution is applied only to larger ones).
                self.cached_distribution = _NOTHING_TO_DISTRIBUTE

    return SaveParallelizationForRoles


_NOTHING_TO_DISTRIBUTE = ()


def hetero_pretrain(pretrain: Callable, argv: list[str]) -> tuple[Callable, Callable]:
    """(pretrain with HeterMoE's hooks in place, the model builder to give model_provider)."""
    run = HeteroPretrain(list(argv))

    def hetero(*a, **k):
        return run.pretrain(pretrain, *a, **k)

    def parse_with_hooks(parse: Callable) -> Callable:
        """core_v0.19.0's pretrain_gpt.py parses before pretrain(): its parse_and_validate_args,
        with validate_args' hook in place (HeteroPretrain.parsing)."""
        def parse_and_validate(*a, **k):
            with run.parsing():
                return parse(*a, **k)

        return parse_and_validate

    hetero.parse_with_hooks = parse_with_hooks
    return hetero, run.builder
