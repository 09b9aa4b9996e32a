"""megatron-core's DistributedOptimizer class (megatron.core.optimizer.distrib_optimizer) on torch's
Adam: its state dict's save and load, for the block of a Megatron-LM pretrain() call."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from megatron_hetermoe.shims._replace import replaced, wrap


@contextlib.contextmanager
def torch_adam_state_dict() -> Iterator[None]:
    """For the block, DistributedOptimizer's state_dict, load_state_dict and
    _set_main_param_and_optimizer_states fixed for torch's Adam (_torch_adam_replacements: why);
    nothing changes where apex's or transformer-engine's Adam is used."""
    with replaced(_torch_adam_replacements()):
        yield


def _torch_adam_replacements() -> list:
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
    return [(cls, "state_dict", wrap(cls.state_dict, _state_dict_from_step_0)),
            (cls, "load_state_dict", wrap(cls.load_state_dict, _load_at_the_saved_step)),
            (cls, "_set_main_param_and_optimizer_states",
             wrap(cls._set_main_param_and_optimizer_states, _set_states_but_the_step))]


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
