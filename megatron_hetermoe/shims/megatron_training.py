"""Megatron-LM's training package (megatron.training: training, initialize, arguments,
checkpointing; and the legacy fused kernels its initialize builds): what HeterMoE replaces for one
pretrain() call (`pretrain_hooks`, the behaviour passed in by megatron_lm/hooks.py), and what a
CPU rank needs (`cpu_rank`, `no_cuda_arch`). Read from core_v0.16.1 and core_v0.19.0 checkouts
(tests/training/test_megatron_lm_v019.py); the differences between them are decided here, by
the objects at hand (compat.py's megatron_lm_* questions)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

from megatron_hetermoe.shims import parallel_state, torch_cuda
from megatron_hetermoe.shims._replace import replaced, wrap


# ---- CPU ranks ------------------------------------------------------------------------------
def _cpu_arch_version() -> int:
    """A CPU rank's CUDA architecture: none (0), so validate_args applies the pre-Blackwell rules
    (with TP or CP > 1 it asserts CUDA_DEVICE_MAX_CONNECTIONS=1, as on an H100)."""
    return 0


def _no_cuda_arch() -> list:
    """validate_args asks the device's CUDA architecture with TP or CP > 1; a CPU rank has none."""
    import megatron.training.arguments as arguments

    return [(arguments, "get_device_arch_version", _cpu_arch_version)]


def no_cuda_arch_for_good() -> None:
    """arguments.get_device_arch_version answers 0 from now on, in a CPU-only process (core_v0.19.0's
    pretrain_gpt.py validates its flags before pretrain())."""
    for mod, name, new in _no_cuda_arch():
        setattr(mod, name, new)


def _as_if_one_device(initialize_distributed: Callable, *a, **k) -> None:
    """Megatron's _initialize_distributed calls initialize_model_parallel only when
    torch.cuda.device_count() > 0; the CPU backend's device is the CPU (set_device is a no-op)."""
    with torch_cuda.one_device():
        initialize_distributed(*a, **k)


def _seed_cpu_rng_tracker(set_random_seed: Callable, seed_: int, data_parallel_random_init: bool = False,
                          *a, **k) -> None:
    """Megatron seeds its model-parallel RNG tracker only when CUDA devices exist; on CPU ranks
    the CPU backend's tracker gets the seed Megatron's _set_random_seed would give it."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    set_random_seed(seed_, data_parallel_random_init, *a, **k)
    seed = seed_ + 100 * ps.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * ps.get_data_parallel_rank()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def cpu_rank() -> Iterator[None]:
    """For the block, Megatron-LM's initialization on a CPU rank over gloo (with the CPU backend,
    parallel/cpu_backend.py, in place). Megatron asserts CUDA unless told the run may go
    without, builds legacy CUDA kernels with nvcc (core_v0.16.1; core_v0.19.0 has none), asks the
    CUDA architecture in validate_args, and initializes model parallelism and its RNG tracker
    only when CUDA devices exist; these let Megatron's own code do the rest."""
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    init = training.initialize_megatron
    out = [
        (training, "initialize_megatron", lambda *a, **k: init(*a, allow_no_cuda=True, **k)),
        # It calls Megatron's fused kernels only to have torch.compile build them ahead (inductor's
        # C++ on CPU ranks, seconds each); an enabled fusion still builds on first use.
        # (core_v0.19.0 passes it tp_size.)
        (initialize, "_warmup_jit_function", lambda *a, **k: None),
        (initialize, "_initialize_distributed", wrap(initialize._initialize_distributed, _as_if_one_device)),
        (initialize, "_set_random_seed", wrap(initialize._set_random_seed, _seed_cpu_rng_tracker)),
        *_no_cuda_arch(),
    ]
    try:  # core_v0.16.1 builds its legacy CUDA kernels with nvcc; core_v0.19.0 has none
        import megatron.legacy.fused_kernels as fused_kernels
    except ImportError:
        pass
    else:
        out.append((fused_kernels, "load", lambda args: None))
    with replaced(out):
        yield


@contextlib.contextmanager
def validate_args_hook(validate_args: Callable, cpu: bool) -> Iterator[None]:
    """core_v0.19.0: pretrain_gpt.py parses and validates the flags before pretrain()
    (arguments.parse_and_validate_args): for the block, arguments.validate_args calls
    `validate_args(original, *a, **k)` (and, on a CPU rank, `no_cuda_arch`)."""
    import megatron.training.arguments as arguments

    with replaced([(arguments, "validate_args", wrap(arguments.validate_args, validate_args)),
                   *(_no_cuda_arch() if cpu else [])]):
        yield


# ---- pretrain()'s hooks ---------------------------------------------------------------------
@dataclasses.dataclass
class PretrainHooks:
    """What HeterMoE puts in the place of Megatron-LM's functions for one pretrain() call (the
    package docstring of megatron_lm/ says what each changes). A hook is called as
    `hook(original, *args, **kwargs)`; a replacement in place of the original."""
    initialize_distributed: Callable  # hook of initialize._initialize_distributed
    get_forward_backward_func: Callable  # replacement of training.get_forward_backward_func
    get_megatron_optimizer: Callable  # hook of training.get_megatron_optimizer
    get_rng_state: Callable  # hook of checkpointing.get_rng_state
    save_strategy_wrapper: type  # replacement of checkpointing.FullyParallelSaveStrategyWrapper
    calc_params_l2_norm: Callable  # replacement of training.calc_params_l2_norm
    data_iterators: Callable  # hook of training.build_train_valid_test_data_iterators
    validate_args: Callable  # hook of initialize.validate_args (where pretrain() validates)
    track_moe_metrics: Callable  # hook of training.track_moe_metrics (core_v0.16.1)
    reduce_aux_losses: Callable  # hook of moe_utils.reduce_aux_losses_tracker_across_ranks (0.16.1)
    sync_moe_metrics: Callable  # hook of MoEMetricsTracker._sync_metrics (core_v0.19.0)
    reduce_mtp_losses: Callable  # hook of MTPLossLoggingHelper's tracker reduction (either name)
    get_model: Callable | None = None  # hook of training.get_model (a live move builds the rank's model again)
    # hook of training.post_training_step_callbacks: every rank, after each step's log and
    # evaluation and before its checkpoint (a live move happens there)
    post_training_step: Callable | None = None


@contextlib.contextmanager
def pretrain_hooks(h: PretrainHooks) -> Iterator[None]:
    """For the block (one pretrain() call), `h` in Megatron-LM's place: on a CPU rank inside
    `cpu_rank` (read after it, they wrap it). On exit the "with GTP_remat" aliases of
    parallel_state go too (core_v0.19.0)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.training.checkpointing as checkpointing
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    from megatron_hetermoe.compat import (
        megatron_lm_moe_metrics_tracker,
        megatron_lm_mtp_reduce,
        megatron_lm_parses_in_pretrain,
    )

    hooks = [
        (initialize, "_initialize_distributed", wrap(initialize._initialize_distributed, h.initialize_distributed)),
        (training, "get_forward_backward_func", h.get_forward_backward_func),
        (training, "get_megatron_optimizer", wrap(training.get_megatron_optimizer, h.get_megatron_optimizer)),
        (checkpointing, "get_rng_state", wrap(checkpointing.get_rng_state, h.get_rng_state)),
        (checkpointing, "FullyParallelSaveStrategyWrapper", h.save_strategy_wrapper),
        (training, "calc_params_l2_norm", h.calc_params_l2_norm),
        (training, "build_train_valid_test_data_iterators",
         wrap(training.build_train_valid_test_data_iterators, h.data_iterators)),
    ]
    if megatron_lm_parses_in_pretrain():
        hooks.append((initialize, "validate_args", wrap(initialize.validate_args, h.validate_args)))
    if h.get_model is not None:
        hooks.append((training, "get_model", wrap(training.get_model, h.get_model)))
    if h.post_training_step is not None:
        hooks.append((training, "post_training_step_callbacks",
                      wrap(training.post_training_step_callbacks, h.post_training_step)))
    if hasattr(training, "track_moe_metrics"):  # core_v0.16.1's training_log (0.19: not yet)
        hooks.append((training, "track_moe_metrics", wrap(training.track_moe_metrics, h.track_moe_metrics)))
    tracker = megatron_lm_moe_metrics_tracker()
    if tracker is None:
        hooks.append((moe_utils, "reduce_aux_losses_tracker_across_ranks",
                      wrap(moe_utils.reduce_aux_losses_tracker_across_ranks, h.reduce_aux_losses)))
    else:
        hooks.append((tracker, "_sync_metrics", wrap(tracker._sync_metrics, h.sync_moe_metrics)))
    mtp, _ = megatron_lm_mtp_reduce()
    hooks.append((MTPLossLoggingHelper, mtp,
                  staticmethod(wrap(getattr(MTPLossLoggingHelper, mtp), h.reduce_mtp_losses))))
    with replaced(hooks):
        try:
            yield
        finally:
            parallel_state.unalias_gtp_remat_groups()



def adopt_in_place(held: object, new: object) -> None:
    """`held` becomes `new` (its class and attributes) while keeping its identity: Megatron-LM's
    train() holds its optimizer in a local variable for the whole run (and its LR scheduler holds
    it too), so a live move's rebuilt optimizer takes the place of the object train() holds."""
    held.__class__ = new.__class__
    held.__dict__ = new.__dict__
