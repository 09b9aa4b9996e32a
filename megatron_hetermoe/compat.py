"""megatron-core 0.16.1 .. 0.19.x: the API differences this plugin touches, in one place.

The plugin is written against megatron-core 0.16.1 (ModuleSpec layer specs, an MoELayer that the
TransformerLayer builds with the spec's params only). Newer releases changed a few of the surfaces
it touches; each change is bridged here, decided by the installed version or by the object at
hand, so call sites stay as they were and 0.16.1 takes exactly the code path it always took
(`hetermoe parity` reports on 0.16.1 are byte-identical before and after this module).

How the facts below were found: by running the parity, zebra, checkpoint, golden, CPU-backend
and patch tests under both ends (`make compat`), by comparing the signatures and dataclass fields
of everything the plugin calls between the two installs, and by reading Megatron-LM's tags
core_v0.16.1, core_v0.17.0, core_v0.18.0 and core_v0.19.0 to date each change. Run: Python 3.11
+ torch 2.13.0 (CPU build) + megatron-core 0.16.1 (CI), and Python 3.12 + torch 2.14.1 (the
CUDA 13 build the registry gives, run on CPU) + megatron-core 0.19.2 (make compat). 0.17 and
0.18 are covered by the same rules but were not run. On 0.19.2 the parity report of a 1+3 plan
(distep and zebra, 3 steps) is byte-identical to 0.16.1's.

What changed, and what the plugin does about it
-----------------------------------------------
1. Layer specs (0.18). `get_gpt_layer_local_spec(num_experts=...)` used to put
   `ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=ModuleSpec(SequentialMLP,...)))`
   in `submodules.mlp`; 0.18+ put builders there: `functools.partial(MoELayer,
   submodules=MoESubmodules(experts=partial(SequentialMLP, submodules=MLPSubmodules(...)),
   shared_experts=partial(...)))`. A partial has no `.module`/`.params`/`.submodules`, so
   swapping the mlp class (hetero_layer_spec) and finding the experts spec (expert ranks) failed:
   "AttributeError: 'functools.partial' object has no attribute 'submodules'".
   -> `normalize_layer_spec` turns those builders back into ModuleSpecs, 0.16.1's form
   (`models.builder.layer_spec` applies it, so every caller sees one form). ModuleSpec is callable
   since 0.17, so 0.18+'s `self.submodules.experts(n, config, pg_collection=..., name=...)` and
   TransformerLayer's `submodules.mlp(...)` build from it as from the builders. 0.16.1: identity.
2. TransformerLayer -> mlp keywords (0.18). 0.16/0.17 pass `pg_collection` only when the mlp
   class is exactly MoELayer (a subclass gets none, so the spec's params carry it); 0.18+ call
   `submodules.mlp(config=, pg_collection=, is_mtp_layer=, name=)` for every mlp, so a
   `pg_collection` in the params is given twice ("got multiple values for keyword argument") and
   a subclass must take `is_mtp_layer` and `name`.
   -> `set_moe_layer` leaves `pg_collection` out of the params on 0.18+ (the layer gets the one
   GPTModel(pg_collection=) hands down, which the hetero trainer builds with the same collection);
   HeteroMoELayer passes unknown keywords on to MoELayer.
3. MoELayer (0.18): experts are made by calling `submodules.experts(...)` instead of
   `build_module(...)`; new keywords `name=`, `is_mtp_layer=`; new inference-only and
   delayed-wgrad paths, off by default. The dispatcher protocol (dispatch_preprocess,
   token_dispatch, dispatch_postprocess, combine_preprocess, token_combine, combine_postprocess)
   and MoELayer.route / preprocess / dispatch / routed_experts_compute / combine / postprocess
   keep their signatures; 0.19 adds `MoETokenDispatcher.get_expert_zero_copy_buffers()` (the base
   class returns (None, None): HeteroTokenDispatcher inherits it).
   -> `build_experts` builds from a ModuleSpec or class (0.16.1) or calls a builder.
4. moe_utils.permute (0.17) returns 5 values (tokens, probs, sorted indices, pad offsets, tokens
   per expert) instead of 3 ("ValueError: too many values to unpack (expected 3)").
   -> `permute` returns the first three on every version. `unpermute` gains an optional
   `pad_offsets` (0.19); `sort_chunks_by_idxs` is unchanged. The alltoall dispatcher calls
   `tensor_parallel.all_to_all(group, input, out_splits, in_splits, use_nccl_stream=...)` on
   0.19 (a new keyword): the EP emulation's hook on it (emulation/emulator.py) passes keywords through.
5. Without transformer-engine, 0.13-0.16 leave `moe_utils.te_general_gemm` unbound (NameError in
   the router on any device); 0.17 binds it to None. `shims.moe_utils.bind_missing_te_general_gemm` does it
   (tests/test_compat.py shows the upstream state). CPU backend (cpu_backend.py chooses its
   patches by version, NEEDED_IN): cuda_streams, current_device, rng,
   split_sizes_to_cpu and cuda_device_literals are still needed on 0.19 (canaries, same sites:
   the alltoall dispatcher's side stream, grad buffers, the RNG tracker, split sizes handed to
   all_to_all_single as tensors, the optimizer's device="cuda"). With a CUDA build of torch on a
   machine without a GPU (what the registry gives for 0.17+), failures read differently from the
   CPU build's "Torch not compiled with CUDA enabled": "CUDA driver version is insufficient" at
   the first CUDA call, "Cannot re-initialize CUDA in forked subprocess" in a forked rank.
   Multi-latent attention on the local spec (every CPU rank; CUDA ranks without transformer-engine):
   MLASelfAttention builds its core with k_channels/v_channels, which the local spec's
   DotProductAttention does not take in any tag (0.16.1, 0.17.0, 0.17.1, 0.18.0, 0.18.2, 0.19.0 and
   main d98e8a6 read: the file is unchanged), so cpu_backend's core_attention_kv_channels is needed on
   every release; 0.16.1's multi_latent_attention also sets HAVE_TE when transformer-engine is missing
   (the extension's names import as MagicMock stand-ins), so isinstance(linear_proj, TELinear) fails:
   0.17.0 imports HAVE_TE from the extension (mla_have_te: 0.16.x only).
6. ProcessGroupCollection (0.19) gains optional fields (gtp_remat, expt_gtp_remat, dp_cp_ag,
   expt_dp_ag, dp_cp_gtp_remat, expt_dp_gtp_remat, tp_ep_pp_with_egtp_remat). All are read with
   fallbacks (tp_ep_pp_with_egtp_remat -> tp_ep_pp; gtp_remat groups -> None, inactive), so the
   hetero collection (parallel.state.HeteroParallelState.pg_collection) needs none of them. Note:
   finalize_model_grads on 0.19 also reads the *global* gtp_remat groups
   (use_mpu_process_groups); without initialize_model_parallel they are None and it is a no-op.
7. Unchanged for what the plugin passes (signatures and fields compared): DistributedDataParallel
   (config, ddp_config, module, pg_collection=) (0.19 adds full_param_layout=);
   DistributedDataParallelConfig / OptimizerConfig / TransformerConfig fields set here (0.19 adds
   fields, removes none of these); get_megatron_optimizer(config, [model],
   use_gloo_process_groups=, pg_collection=); OptimizerParamScheduler; finalize_model_grads(model,
   num_tokens, pg_collection=, force_all_reduce=); get_forward_backward_func(pp_size, vp_size)
   (0.19 adds schedule_pg_collection=) and the schedules' keyword signature (pg_collection may
   also be a MultiModuleProcessGroupCollection); model_parallel_cuda_manual_seed and
   initialize_rng_tracker; parallel_state._set_global_memory_buffer /
   destroy_global_memory_buffer; initialize_model_parallel's arguments used here;
   dist_checkpointing.save/load/load_common_state_dict as called (0.19 drops the
   `common_strategy` argument, not used here); GPTModel.sharded_state_dict and
   DistributedOptimizer.sharded_state_dict; TransformerLayer._forward_attention /
   _forward_pre_mlp_layernorm / _forward_post_mlp and GPTModel._postprocess (zebra's stage cuts;
   Megatron-LM main renames _forward_post_mlp to _apply_mlp_bda_step: `mlp_bias_dropout_add`).
   0.19 logs "GPTModel IS DEPRECATED" (critical fixes only; HybridModel is its successor).
8. Megatron-LM's pretrain_gpt.py: core_v0.19.0 parses its arguments itself
   (`parse_and_validate_args(extra_args_provider=...)`) before `pretrain(full_config, ...)`, so
   the core_v0.16.1 patch does not apply there; patches/ has one per release line
   (megatron_lm.PATCHES). core_v0.19.0's parser keeps every Megatron-LM flag that
   `python -m megatron_hetermoe.training.pretrain_gpt` takes (845 flags against 0.16.1's 680), and
   importing its pretrain_gpt.py needs no six/regex/pydantic (0.16.1's needs them and triton).
9. Megatron-LM's own pretrain() with --hetero-plan (megatron_lm/, both patches; read in core_v0.16.1
   and core_v0.19.0, run on both): the same hooks, with these differences in core_v0.19.0.
   - The flags are parsed and validated before pretrain() (arguments.parse_and_validate_args calls
     arguments.validate_args; core_v0.16.1's initialize_megatron calls initialize.validate_args):
     validate_args' hook is put on the parse there (`megatron_lm_parses_in_pretrain`).
   - pretrain(cfg_container, ..., model_provider=None) builds the model from the container's
     GPTModelConfig; with model=None it uses model_provider (get_model), as core_v0.16.1 always does:
     the patch passes model_provider with the plugin's builder and the hook drops the model.
   - parallel_state's data-parallel groups "with GTP_remat" (and the expert tensor-model-pipeline
     group "with EGTP") are the defaults ProcessGroupCollection.use_mpu_process_groups and the
     optimizer read: set to the groups without it (GTP_remat size 1).
   - MoE metrics: training_log reports through moe_logging.MoEMetricsTracker (its _sync_metrics)
     instead of moe_utils.reduce_aux_losses_tracker_across_ranks (`megatron_lm_moe_metrics_tracker`);
     MTP: MTPLossLoggingHelper.reduce_metrics_in_tracker over loss/correct/total instead of
     reduce_loss_in_tracker over values (`megatron_lm_mtp_reduce`).
   - The optimizer clips the MTP block's parameters by a norm of their own (SEPARATE_GRAD_NORM_GROUPS);
     each sub-optimizer decides at its first step whether any rank has such parameters, with an
     all_reduce per sub-optimizer, which hangs where roles hold different numbers of them (Asym-EA):
     decided once over the world in get_megatron_optimizer's hook. (MTP runs on 0.19: not run.)
   - CPU layer: no megatron.legacy.fused_kernels (nothing to skip); _warmup_jit_function takes tp_size.
   - get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group) takes a required is_hybrid_cp
     (0.16.1: batch, cp_group): `batch_on_this_cp_rank` passes False where it is asked for.
   - Not the plugin's: NullTokenizer --vocab-size N has N tokens (EOD N-1; core_v0.16.1 N+1, EOD N),
     and a run without --eval-interval fails in get_train_valid_test_num_samples.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import re
import sys
from pathlib import Path

#: Releases this module bridges (inclusive lower bound, exclusive upper bound).
SUPPORTED = ((0, 16, 1), (0, 20, 0))


@functools.lru_cache(maxsize=None)
def mcore_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the megatron-core that `import megatron.core` finds (an installed
    wheel or a Megatron-LM checkout on the path). Read from its package_info.py without importing
    megatron.core, so cpu_backend can choose its patches before megatron-core is imported."""
    info = sys.modules.get("megatron.core.package_info")
    if info is not None:
        return int(info.MAJOR), int(info.MINOR), int(info.PATCH)
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron-core is not installed (pip install megatron-core)")
    text = (Path(list(spec.submodule_search_locations)[0]) / "package_info.py").read_text()
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ImportError(f"cannot read megatron-core's version from {spec.submodule_search_locations}")
    return tuple(int(m.group(1)) for m in parts)


def mcore_at_least(major: int, minor: int, patch: int = 0) -> bool:
    return mcore_version() >= (major, minor, patch)


def is_supported(version: tuple[int, int, int] | None = None) -> bool:
    v = version or mcore_version()
    return SUPPORTED[0] <= tuple(v) < SUPPORTED[1]


# --- layer specs ------------------------------------------------------------------------------
def _builder_to_spec(spec_or_builder):
    """partial(cls, submodules=S, **params) -> ModuleSpec(module=cls, submodules=S, params=params);
    anything else is returned unchanged."""
    if not isinstance(spec_or_builder, functools.partial) or not isinstance(spec_or_builder.func, type):
        return spec_or_builder
    from megatron.core.transformer.spec_utils import ModuleSpec

    kw = dict(spec_or_builder.keywords)
    sub = kw.pop("submodules", None)
    if spec_or_builder.args:
        raise TypeError(f"cannot express {spec_or_builder!r} as a ModuleSpec: it binds positional arguments")
    return ModuleSpec(module=spec_or_builder.func, submodules=sub, params=kw)


def normalize_layer_spec(layer_spec):
    """The GPT layer spec with its MoE mlp (and the mlp's experts) as ModuleSpecs, 0.16.1's form.

    0.16.1/0.17: returns `layer_spec` itself. 0.18+: a copy whose `submodules.mlp` is
    ModuleSpec(MoELayer, submodules=MoESubmodules(experts=ModuleSpec(SequentialMLP, ...))).
    """
    mlp = layer_spec.submodules.mlp
    if not isinstance(mlp, functools.partial):
        return layer_spec
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    mlp = _builder_to_spec(mlp)
    if mlp.submodules is not None and hasattr(mlp.submodules, "experts"):
        mlp.submodules = copy.copy(mlp.submodules)
        mlp.submodules.experts = _builder_to_spec(mlp.submodules.experts)
    spec.submodules.mlp = mlp
    return spec


def moe_experts_spec(layer_spec):
    """The experts spec (or builder) of a GPT layer spec's MoE mlp."""
    mlp = layer_spec.submodules.mlp
    sub = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    return sub.experts


def transformer_layer_passes_pg_collection() -> bool:
    """Whether TransformerLayer hands `pg_collection` (and is_mtp_layer, name) to any mlp
    (0.18+), not only to exactly MoELayer (0.16, 0.17)."""
    return mcore_at_least(0, 18)


def set_moe_layer(layer_spec, cls, **params) -> None:
    """In place: make the layer spec's MoE mlp (a ModuleSpec, see normalize_layer_spec) build
    `cls` with `params` added to the spec's params."""
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        raise TypeError("set_moe_layer needs a ModuleSpec mlp: pass the spec through normalize_layer_spec first")
    if transformer_layer_passes_pg_collection():
        params.pop("pg_collection", None)  # the TransformerLayer passes it; twice is a TypeError
    mlp.module = cls
    mlp.params = dict(mlp.params or {}, **params)


def build_experts(experts_spec, num_local: int, config, pg_collection):
    """Build `num_local` experts from a ModuleSpec / class (0.16.1) or an experts builder (0.18+)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(experts_spec, (ModuleSpec, type)):
        return build_module(experts_spec, num_local, config, pg_collection=pg_collection)
    return experts_spec(num_local, config, pg_collection=pg_collection)


# --- zebra's cut of a TransformerLayer around its MLP --------------------------------------------
def pre_mlp_layernorm(layer, hidden):
    """The layer's pre-MLP norm of `hidden` (the MLP's input); `hidden` stays the residual. Megatron-LM
    main (0.20 dev) lets a norm return the residual too (`returns_residual`, a fused norm-add): zebra
    does not cut such a layer, so it is refused by name rather than given the wrong residual."""
    if getattr(layer, "_pre_mlp_layernorm_returns_residual", False):
        raise NotImplementedError(f"{type(layer.pre_mlp_layernorm).__name__} returns the residual (a fused norm-add): "
                                  f"HeterMoE's stage cut takes a pre-MLP norm that returns its output alone; use "
                                  f"Megatron's local or TE layer norm")
    return layer._forward_pre_mlp_layernorm(hidden)


def mlp_bias_dropout_add(layer, output_with_bias, residual):
    """The layer's steps after its MLP (bias-dropout-add onto the residual, viewless output):
    TransformerLayer._forward_post_mlp through 0.19; renamed _apply_mlp_bda_step in Megatron-LM main
    (0.20 dev), with an mlp_state that the base layer ignores (() here)."""
    if hasattr(layer, "_apply_mlp_bda_step"):
        return layer._apply_mlp_bda_step(output_with_bias, residual)
    return layer._forward_post_mlp(output_with_bias, residual)


# --- MoE token permutation ----------------------------------------------------------------------
def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused: bool = False):
    """megatron-core's moe_utils.permute: (permuted tokens, permuted probs (None without `probs`),
    sorted indices; with `fused`, transformer-engine's row map, which only the fused unpermute
    reads) on every version (0.17+ return two more values)."""
    from megatron.core.transformer.moe.moe_utils import permute as _permute

    out = _permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused)
    return out[0], out[1], out[2]


# --- Megatron-LM's training side (megatron/training, a checkout's; megatron_lm/) ----------------
# Decided by the objects at hand, since the training side is the checkout's: core_v0.16.1 and
# core_v0.19.0 were read and run (tests/training/test_megatron_lm_v019.py); 0.17/0.18 were not.
def megatron_lm_parses_in_pretrain() -> bool:
    """Whether Megatron-LM's pretrain() parses and validates the flags itself (core_v0.16.1:
    initialize_megatron(extra_args_provider=...) calls validate_args), or pretrain_gpt.py does it
    before pretrain() (core_v0.19.0: arguments.parse_and_validate_args, then
    pretrain(cfg_container, ...))."""
    import inspect

    import megatron.training.initialize as initialize

    return "extra_args_provider" in inspect.signature(initialize.initialize_megatron).parameters


def megatron_lm_moe_metrics_tracker():
    """core_v0.19.0's MoEMetricsTracker class (training_log reports the routers' losses through
    get_moe_metrics_tracker().report(), which syncs them in _sync_metrics), or None where the
    module-level moe_utils.reduce_aux_losses_tracker_across_ranks does (core_v0.16.1)."""
    try:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    except ImportError:
        return None
    return MoEMetricsTracker


def megatron_lm_mtp_reduce() -> tuple[str, tuple[str, ...]]:
    """The MTPLossLoggingHelper static method that reduces the MTP logging tracker across ranks, and
    the tracker keys it reduces: `reduce_loss_in_tracker` over "values" (core_v0.16.1) or
    `reduce_metrics_in_tracker` over "loss_values", "correct_values", "total_values" (core_v0.19.0)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, "reduce_loss_in_tracker"):
        return "reduce_loss_in_tracker", ("values",)
    return "reduce_metrics_in_tracker", ("loss_values", "correct_values", "total_values")


def batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """megatron-core's get_batch_on_this_cp_rank over `cp_group` (Megatron's load-balanced split), with
    hybrid context parallelism off where the release asks (0.19: a required is_hybrid_cp)."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)
