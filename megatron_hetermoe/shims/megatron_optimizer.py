"""Instances of megatron-core's optimizers (MegatronOptimizer, its mixed-precision and distributed
forms, ChainedOptimizer): step pieces, the zero count, the grad-norm inputs and the state dict's
I/O replaced on one object, with HeterMoE's behaviour passed in (training/, checkpoint/). The
class stays Megatron's: only that object changes, so other optimizers of the process don't."""
from __future__ import annotations

from typing import Callable


def replace_prepare_grads(optimizer, prepare_grads: Callable[[], bool]) -> None:
    """`optimizer.prepare_grads()` (copy to main grads, unscale, find infs; True when found) calls
    `prepare_grads` instead. Why: one loss scale for the world needs the finding OR-ed over the
    world once per step, not per sub-optimizer (training/step.py share_loss_scale)."""
    optimizer.prepare_grads = prepare_grads


def replace_step_with_ready_grads(optimizer, step: Callable[[], bool]) -> None:
    """`optimizer.step_with_ready_grads()` calls `step` instead. Why: the distributed optimizer's
    param all-gathers must run once per step, after every sub-optimizer stepped
    (training/assembly.py _one_param_sync)."""
    optimizer.step_with_ready_grads = step


def replace_count_zeros(optimizer, count_zeros: Callable[[], float]) -> None:
    """`optimizer.count_zeros()` (--log-num-zeros-in-grad) calls `count_zeros` instead. Why:
    Megatron's count per sub-optimizer group would count every copy of a replicated gradient
    (training/world_stats.py counts each once over the world)."""
    optimizer.count_zeros = count_zeros


def replace_grad_norm(optimizer, norm: Callable[[str | None], float]) -> None:
    """A ChainedOptimizer's gradient norms (the one its step clips by; on megatron-core 0.19 also a
    separate grad-norm group's, `_get_grad_norm_for_group`) come from `norm(group)` instead. Why:
    Megatron's norm reduces partial sums whose grouping follows where the experts sit; HeterMoE's
    (training/world_stats.py world_grad_norm) does not, so moving experts leaves it bitwise equal."""
    optimizer.get_grad_norm = lambda: norm(None)
    optimizer._get_grad_norm_for_group = norm


def replace_state_dict_io(optimizer, sharded_state_dict: Callable, load_state_dict: Callable) -> None:
    """`optimizer.sharded_state_dict(...)` and `optimizer.load_state_dict(...)` call these instead
    (each wraps the original it read before). Why: a HeterMoE rank's optimizer state is saved as
    one shard per rank, resharded between plans (checkpoint/megatron_optimizer.py)."""
    optimizer.sharded_state_dict = sharded_state_dict
    optimizer.load_state_dict = load_state_dict
