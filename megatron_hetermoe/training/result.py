"""What a training run returns (rank 0's view, router_expert_bias each rank's own; both trainers)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    losses: list[float]  # the world's token-weighted lm loss per step
    step_times: list[float]  # seconds per step
    start_iteration: int  # 0, or the resumed checkpoint's iteration
    num_microbatches: int
    dp: int  # data-parallel size (HeterMoE: the attention ranks)
    skipped: list[int]  # steps the NaN check skipped
    loss_scales: list[float]  # after each step (1.0 without a grad scaler)
    overflow_skipped: list[int]  # steps the grad scaler skipped
    param_dtypes: list[str]  # of this rank's module
    kernels: str  # models.builder.choose_kernels' choice
    kernels_reason: str
    busy_s: list  # seconds each rank spent in compute during the last step
    grad_norms: list = field(default_factory=list)  # the grad norm each step was clipped by (None: skipped)
    emulation: dict | None = None  # the emulation clock's report (an --emulate run)
    peak_gpu_mib: list[tuple[str, float]] | None = None  # [(role, MiB)] per rank; CUDA ranks only
    # RunHooks.collect_grads: canonical parameters at the end, and every step's gradients.
    params: dict | None = None
    grads: list[dict] = field(default_factory=list)
    # HeterMoE only
    schedule: str | None = None
    executed: list = field(default_factory=list)  # the last step's task order: [(compute, {stream: transfers})]
    peak_activation_mib: float = 0.0  # rank 0's peak saved-for-backward memory in the last task-list step
    peak_rss_mib: list[tuple[str, float]] | None = None  # [(role, MiB)] per rank
    # Megatron EP only (collect_grads): the canonical parameters before every step.
    step_params: list[dict] = field(default_factory=list)
    initial_params: dict | None = None
    # This rank's routers' aux-loss-free expert bias at the end (canonical name -> one value per
    # expert; models.builder.router_expert_bias): empty without it, and on HeterMoE's expert ranks.
    router_expert_bias: dict = field(default_factory=dict)
    # --hetero-replan-interval: each live move (training/replan.py MoveRecord.as_dict) and the plan run last.
    moves: list[dict] = field(default_factory=list)
    stays: list[dict] = field(default_factory=list)  # ... and each decision not to move, with its reason (first rank)
    plan: dict | None = None
