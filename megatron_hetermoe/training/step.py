"""One optimizer step's pieces, shared by the Megatron EP and HeterMoE trainers: Megatron's GPT
forward_step and loss, Megatron's Adam with its cosine schedule, one loss scale for the world
(share_loss_scale), and the canonical gather of parameters or gradients over every rank. The
world-wide gradient norm is Megatron's optimizer's own over the world's groups (assembly.py)."""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron_hetermoe.config import TrainConfig
from megatron_hetermoe.plan.expert_names import expand
from megatron_hetermoe.shims import megatron_optimizer


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's GPT loss: token-summed loss and token count, reported as 'lm loss'."""
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), num_tokens.float()])}


def batch_to(batch: dict, device: torch.device) -> dict:
    """A microbatch's tensors on `device` (the data source builds them on the CPU); the same
    tensors when they are there already."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, partial(loss_func, batch["loss_mask"])


def build_optimizer(cfg: TrainConfig, model, clip_grad: float, use_distributed_optimizer: bool,
                    pg_collection=None, precision: str | None = None):
    """Megatron's Adam and its cosine LR schedule, as both trainers use them: (optimizer,
    scheduler, its OptimizerConfig). `precision`: the model's (default the world's,
    cfg.precision; a HeterMoE rank's pool's)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_hetermoe.models.builder import precision_dtype

    precision = precision or cfg.precision
    # bf16/fp16: Megatron's mixed-precision optimizer (fp32 main params and grads) and its
    # grad scaler (constant with --loss-scale, dynamic for fp16 without, none for bf16 without).
    opt_config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, clip_grad=clip_grad, bf16=precision == "bf16", fp16=precision == "fp16",
        params_dtype=precision_dtype(precision), use_distributed_optimizer=use_distributed_optimizer,
        loss_scale=cfg.loss_scale, initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
    )
    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=False, **kw)
    steps = max(cfg.train_iters, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters, lr_decay_steps=steps, lr_decay_style="cosine",
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
    )
    return optimizer, scheduler, opt_config


def attach_dynamic_scaler(optimizer, opt_config) -> None:
    """Give each bf16 sub-optimizer without a grad scaler the dynamic one Megatron builds for
    fp16 (its --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis), as
    MixedPrecisionOptimizer.__init__ would have set it up: the scaler and its found_inf flag.
    Megatron's bf16 path takes a scaler (its prepare_grads unscales and checks for inf whenever
    one is set); only its factory does not make a dynamic one for bf16."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(o, "grad_scaler", "absent") is not None:
            continue  # fp32 (no scaler attribute) or a scaler already
        device = o.get_loss_scale().device
        o.grad_scaler = DynamicGradScaler(
            initial_scale=opt_config.initial_loss_scale, min_scale=opt_config.min_loss_scale, growth_factor=2.0,
            backoff_factor=0.5, growth_interval=opt_config.loss_scale_window, hysteresis=opt_config.hysteresis)
        o.found_inf = torch.tensor([0.0], dtype=torch.float, device=device)


class _OneScaler:
    """Every sub-optimizer's grad scaler on a rank: scale and inv_scale are one Megatron scaler's;
    update() only records that a sub-optimizer found an inf (share_loss_scale updates once)."""

    def __init__(self, scaler):
        self.scaler, self.found = scaler, False

    @property
    def scale(self) -> torch.Tensor:
        return self.scaler.scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self.scaler.inv_scale

    def update(self, found_inf: bool) -> None:
        self.found |= bool(found_inf)

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scaler.load_state_dict(state_dict)


def share_loss_scale(optimizer, group, device: torch.device, check_group=None) -> None:
    """One loss scale for the world: every sub-optimizer (dense, expert) of every rank in `group`
    skips the same steps and holds the same scale. No-op without a grad scaler (fp32; bf16
    without --loss-scale).

    Megatron all-reduces found_inf per sub-optimizer over its grad-stats group (model parallel)
    and updates that sub-optimizer's own scaler. Both break here: (1) ranks hold different
    sub-optimizers (an attention rank without offloaded experts has no expert one), so a
    per-sub-optimizer collective over the world would not pair up across ranks; (2) an inf seen
    only by expert gradients (e.g. on an expert rank) would back off the expert scaler but not
    the dense one whose scale the loss is multiplied by. So the sub-optimizers share one scaler,
    their own all-reduce stays on their (model-parallel) group, and the chain's prepare_grads
    ORs their findings over `group` once and updates the one scaler with it. Their
    grad-stats group, and so Megatron's grad norm (unused with clip_grad=0 in HeterMoE, which
    clips on its own exact global norm), is left as it was. `check_group`: where the grad-stats
    group is the world (Megatron-LM's pretrain(), whose grad norm is taken over it), the group
    each sub-optimizer's own found_inf all-reduce runs over instead, during the check only (this
    rank alone: the per-sub-optimizer collectives would not pair up over the world)."""
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    scalers = [getattr(o, "grad_scaler", None) for o in subs]
    if not any(s is not None for s in scalers):
        return
    one = _OneScaler(next(s for s in scalers if s is not None))
    for o, s in zip(subs, scalers):
        if s is not None:
            o.grad_scaler = one
    per_rank = optimizer.prepare_grads

    @torch.no_grad()
    def prepare_grads() -> bool:
        one.found = False
        kept = [(o, o.grad_stats_parallel_group) for o in subs if check_group is not None]
        for o, _ in kept:
            o.grad_stats_parallel_group = check_group
        try:
            per_rank()  # copy to main grads, unscale, check: each sub-optimizer records into `one`
        finally:
            for o, g in kept:
                o.grad_stats_parallel_group = g
        flag = torch.tensor([1.0 if one.found else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        found = bool(flag.item() > 0)
        one.scaler.update(found)
        return found

    megatron_optimizer.replace_prepare_grads(optimizer, prepare_grads)


def loss_scale_of(optimizer) -> float:
    """The loss scale the step's gradients carry (1.0 without a grad scaler)."""
    return float(optimizer.get_loss_scale().item())


def gather_canonical(model_chunks, names_per_chunk, attr: str, scale: float = 1.0,
                     tp_group=None) -> dict[str, torch.Tensor]:
    """{canonical name: CPU tensor} of params (attr='data') or grads (attr='main_grad') from every
    rank, merged on all ranks (times `scale`: 1/loss scale for grads). Replicas hold equal
    values, so the first copy is kept. With `tp_group` (Megatron's TP group, size > 1), each
    TP-split parameter is first gathered over it into the canonical full tensor
    (models/tp_shards.py)."""
    from megatron_hetermoe.models import tp_shards
    from megatron_hetermoe.models.builder import unwrap

    local = {}
    for chunk, names in zip(model_chunks, names_per_chunk):
        glu = bool(getattr(getattr(unwrap(chunk), "config", None), "gated_linear_unit", True))
        specs = tp_shards.module_specs(chunk, tp_group, glu)
        for n, p in chunk.named_parameters():
            t = getattr(p, attr, None)
            if t is None and attr == "main_grad":
                t = p.grad
            t = t.detach().clone().float() if t is not None else torch.zeros_like(p, dtype=torch.float)
            if scale != 1.0:
                t.mul_(scale)
            t = tp_shards.gathered(t, specs[n], tp_group)
            local[names[n]] = t.cpu()  # pickled: a CUDA tensor would unpickle onto the sender's GPU
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, local)
    merged: dict[str, torch.Tensor] = {}
    for d in world:
        for k, v in d.items():
            merged.setdefault(k, v)
    return expand(merged)  # GroupedMLP's packed tensors -> one canonical name per expert
