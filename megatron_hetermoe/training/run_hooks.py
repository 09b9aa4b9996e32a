"""What a caller hands a trainer at build time besides its configuration: runtime objects and
test seams, never flags (config.py holds only data). Both trainers take it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Callable

    import torch

    from megatron_hetermoe.parallel.extension import TaskTiming, Transport
    from megatron_hetermoe.parallel.state import HeteroParallelState
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan
    from megatron_hetermoe.training.nan_check import NanInjection


@dataclass
class RunHooks:
    # Start from this plain Megatron state dict (canonical names) instead of the layout-invariant init.
    init_state: dict | None = None
    # Parity at identical parameters: before step i, load pin_params[i] (canonical names), so a
    # step's gradient is measured at another run's parameters, not at a drifted trajectory.
    pin_params: list[dict] | None = None
    # Report the canonical parameters (before every step and at the end) and every step's gradients.
    collect_grads: bool = False
    # A NaN into one rank's gradient or loss at one step (the NaN check's tests).
    nan_injection: "NanInjection | None" = None
    # Time every task of a HeterMoE task list (tests; an --emulate run makes the emulated cluster's).
    task_timing: "TaskTiming | None" = None
    # Another token backend (parallel/extension.Transport), made from the rank's state, instead of
    # the split-size one HeteroParallelState.transport picks.
    transport: "Callable[[HeteroParallelState], Transport] | None" = None
    # The rank's device when not the one its world's backend implies (parallel/device.rank_device:
    # CUDA under NCCL, else the CPU): CUDA tensors over gloo (scripts/gpu_check, 2 ranks on one GPU).
    device: "torch.device | None" = None
    # --hetero-replan-interval: decide the placement instead of the load rule (tests of live moves):
    # replan(iteration, plan) -> the plan to move to, or None to stay; called on the first rank.
    replan: "Callable[[int, HeteroPlan], HeteroPlan | None] | None" = None
