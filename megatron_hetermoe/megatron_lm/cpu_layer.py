"""Megatron-LM's pretrain() on CPU ranks over gloo, HeterMoE or not: what Megatron-LM needs besides
the CPU backend (parallel/cpu_backend.py), in place for one call; and the helpers that put any
replacement in place for a block (the hooks use them too)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


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
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    from megatron_hetermoe.compat import bind_missing_te_general_gemm
    from megatron_hetermoe.parallel import cpu_backend

    cpu_backend.apply()
    bind_missing_te_general_gemm()  # megatron's router needs it without transformer-engine (compat.py)
    init = training.initialize_megatron
    out = [
        (training, "initialize_megatron", lambda *a, **k: init(*a, allow_no_cuda=True, **k)),
        # It calls Megatron's fused kernels only to have torch.compile build them ahead (inductor's
        # C++ on CPU ranks, seconds each); an enabled fusion still builds on first use.
        # (core_v0.19.0 passes it tp_size.)
        (initialize, "_warmup_jit_function", lambda *a, **k: None),
        (initialize, "_initialize_distributed", _wrap(initialize._initialize_distributed, _as_if_one_device)),
        (initialize, "_set_random_seed", _wrap(initialize._set_random_seed, _seed_cpu_rng_tracker)),
        # The interleaved schedule (--overlap-p2p-comm) frees a stage's output
        # (deallocate_output_tensor) right after starting its asynchronous send: safe with NCCL,
        # which sends on a stream the caching allocator waits for, but gloo's isend still reads
        # the freed buffer from its own thread, and the next stage receives garbage now and then
        # (measured: 3 of 3 HeterMoE runs off by up to 0.14 in the loss). CPU ranks keep outputs,
        # and backward goes through torch.autograd.backward, which custom_backward stands in for
        # only so that a freed output's shape goes unchecked.
        (schedules, "deallocate_output_tensor", lambda out, deallocate_pipeline_outputs=False: None),
        (schedules, "custom_backward", lambda output, grad_output: torch.autograd.backward(output, grad_output)),
        *_no_cuda_arch(),
        *torch_adam_replacements(),
    ]
    try:  # core_v0.16.1 builds its legacy CUDA kernels with nvcc; core_v0.19.0 has none
        import megatron.legacy.fused_kernels as fused_kernels
    except ImportError:
        return out
    return out + [(fused_kernels, "load", lambda args: None)]


def torch_adam_replacements() -> list:
    """megatron-core's DistributedOptimizer on torch's Adam (no apex, no transformer-engine: every
    CPU rank) cannot be loaded into: its state_dict reads the step from the Adam state, which is
    empty before the first step (an assertion fails as Megatron-LM builds the state dict to load),
    its load_state_dict copies into views of parameters requiring grad outside no_grad, the step
    it loads is overwritten by that of the state it loaded into (and was one tensor shared by
    every parameter, which torch's Adam advances once per parameter each step), and its fully
    reshardable format's load looks for a per-parameter step it does not save. None where
    apex's or transformer-engine's Adam is used (Megatron keeps the step in the param groups)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    cls = distrib_optimizer.DistributedOptimizer
    return [(cls, "state_dict", _wrap(cls.state_dict, _state_dict_from_step_0)),
            (cls, "load_state_dict", _wrap(cls.load_state_dict, _load_at_the_saved_step)),
            (cls, "_set_main_param_and_optimizer_states",
             _wrap(cls._set_main_param_and_optimizer_states, _set_states_but_the_step))]


def _state_dict_from_step_0(state_dict: Callable, self) -> dict:
    """Before its first step (a run that loads a checkpoint), torch's Adam is at step 0: its
    state gets that step for the call (Megatron then allocates the state and loads into it)."""
    from collections import defaultdict

    inner = self.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    if not params or any("step" in inner.state.get(p, {}) for p in params):
        return state_dict(self)
    state = inner.state
    inner.state = defaultdict(dict, {p: {"step": torch.tensor(0.0)} for p in params})
    try:
        return state_dict(self)
    finally:
        inner.state = state


def _load_at_the_saved_step(load_state_dict: Callable, self, state_dict: dict):
    """Megatron's load, then each parameter's Adam state at the checkpoint's step, in a tensor of
    its own. Megatron sets one shared step tensor from the loaded param_groups, then copies the
    per-parameter state over it, whose `step` is not saved (a LocalNonpersistentObject): the
    state built to load into holds step 0 (_state_dict_from_step_0), so 0 is what remained.
    Under no_grad, as it copies the loaded values into fp32 main parameters that are views of
    parameters requiring grad (autograd refuses the in-place copy otherwise)."""
    with torch.no_grad():
        out = load_state_dict(self, state_dict)
    steps = {g["step"] for g in state_dict["optimizer"]["param_groups"]}
    if len(steps) != 1:
        raise ValueError(f"a distributed optimizer checkpoint with param groups at steps {sorted(steps)}: Megatron "
                         f"saves one step for all of them")
    step = float(steps.pop())
    for st in self.optimizer.state.values():
        if torch.is_tensor(st.get("step")):
            st["step"] = torch.tensor(step, dtype=st["step"].dtype)
    return out


def _set_states_but_the_step(set_states: Callable, self, model_param, tensors: dict) -> None:
    """--dist-ckpt-optim-fully-reshardable loads each parameter's state without its `step` (kept
    in the param groups), and Megatron then copies every key of the Adam state from it: the
    parameter's own step is given back (_load_at_the_saved_step sets it to the checkpoint's)."""
    if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        gi, order = self.model_param_group_index_map[model_param]
        step = self.optimizer.state[self.optimizer.param_groups[gi]["params"][order]].get("step")
        if step is not None:
            tensors = {**tensors, "step": step.clone()}
    return set_states(self, model_param, tensors)


def _cpu_arch_version() -> int:
    """A CPU rank's CUDA architecture: none (0), so validate_args applies the pre-Blackwell rules
    (with TP or CP > 1 it asserts CUDA_DEVICE_MAX_CONNECTIONS=1, as on an H100)."""
    return 0


def _no_cuda_arch() -> list:
    """validate_args asks the device's CUDA architecture with TP or CP > 1; a CPU rank has none."""
    import megatron.training.arguments as arguments

    return [(arguments, "get_device_arch_version", _cpu_arch_version)]


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
    # core_v0.19.0's pretrain_gpt.py validates its flags before pretrain(), in this CPU-only process.
    for mod, name, new in _no_cuda_arch():
        setattr(mod, name, new)

    def on_cpu(*a, **k):
        with _replaced(_cpu_replacements()):
            return pretrain(*a, **k)

    return on_cpu
