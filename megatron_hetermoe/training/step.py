"""One optimizer step's pieces, shared by the Megatron EP and HeterMoE trainers: Megatron's GPT
forward_step and loss, Megatron's Adam with its cosine schedule, and the exact global gradient
norm and clip of a HeterMoE world (each parameter counted once over roles that hold different
parameters)."""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron_hetermoe.config import TrainConfig


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
                    pg_collection=None):
    """Megatron's Adam and its cosine LR schedule, as both trainers use them."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, clip_grad=clip_grad, bf16=False, fp16=False,
        params_dtype=torch.float32, use_distributed_optimizer=use_distributed_optimizer,
    )
    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=False, **kw)
    steps = max(cfg.train_iters, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters, lr_decay_steps=steps, lr_decay_style="cosine",
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
    )
    return optimizer, scheduler


def gather_canonical(model_chunks, names_per_chunk, attr: str) -> dict[str, torch.Tensor]:
    """{canonical name: CPU tensor} of params (attr='data') or grads (attr='main_grad') from every
    rank, merged on all ranks. Replicas hold equal values, so the first copy is kept."""
    local = {}
    for chunk, names in zip(model_chunks, names_per_chunk):
        for n, p in chunk.named_parameters():
            t = getattr(p, attr, None)
            if t is None and attr == "main_grad":
                t = p.grad
            t = t.detach().clone().float() if t is not None else torch.zeros_like(p, dtype=torch.float)
            local[names[n]] = t.cpu()  # pickled: a CUDA tensor would unpickle onto the sender's GPU
    world = [None] * dist.get_world_size()
    dist.all_gather_object(world, local)
    merged: dict[str, torch.Tensor] = {}
    for d in world:
        for k, v in d.items():
            merged.setdefault(k, v)
    return merged


def global_grad_norm(owned_grads, group, device: torch.device) -> float:
    """The exact L2 norm of the whole model's gradient over `group`: each rank passes the
    gradients it owns (every distinct parameter owned by exactly one rank) and its device."""
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for g in owned_grads:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


def clip_coefficient(clip_grad: float, grad_norm: float) -> float:
    """Megatron's rule (clip_grad_by_total_norm_fp32): scale by clip/(norm+1e-6) when below 1;
    1.0 when not clipping."""
    if clip_grad <= 0:
        return 1.0
    coeff = clip_grad / (grad_norm + 1.0e-6)
    return coeff if coeff < 1.0 else 1.0
