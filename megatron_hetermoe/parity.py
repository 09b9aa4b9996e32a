"""`hetermoe parity`: HeterMoE vs plain Megatron EP from the same weights and data.

The reference is Megatron-Core itself (GPTModel, alltoall dispatcher, its schedule, DDP and
optimizer) on as many CPU ranks as the plan has attention ranks, so each reference DP rank sees
exactly the microbatches of one attention rank. HeterMoE starts from the reference's initial
state dict converted to the hetero layout (layout.megatron_to_hetero) and its gradients and
final weights are exported back (layout.hetero_to_megatron) for comparison.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import torch

from .model_builder import ParallelConfig
from .model_config import ModelConfig
from .plan import HeteroPlan
from .trainer import TrainConfig

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def category(name: str) -> str:
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.router." in name:
        return "router"
    if ".self_attention." in name or "layernorm" in name:
        return "attention"
    return "embedding/output"


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    den = b.abs().max().item()
    num = (a - b).abs().max().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


@dataclass
class ParityReport:
    ref_losses: list[float]
    het_losses: list[float]
    max_rel_loss_diff: float
    max_rel_grad_diff: float
    grad_diff_by_category: dict[str, float]
    max_rel_param_diff: float

    def ok(self, loss_tol: float = LOSS_TOL, grad_tol: float = GRAD_TOL) -> bool:
        return self.max_rel_loss_diff <= loss_tol and self.max_rel_grad_diff <= grad_tol


def reference_ep(plan: HeteroPlan, num_experts: int) -> int:
    """Megatron EP size for the reference: the largest that divides both its world (the
    attention ranks) and the expert count."""
    return math.gcd(len(plan.attention_ranks), num_experts)


def run_parity(plan: HeteroPlan, model: ModelConfig, steps: int = 5, micro_batch_size: int = 2,
               seed: int = 1234, timeout_s: float = 600.0, schedule: str | None = None,
               recompute: bool = False, init_state: dict | None = None) -> ParityReport:
    """init_state: start both sides from this plain Megatron state dict (canonical names)
    instead of the seed's layout-invariant init, e.g. weights crafted to force a routing."""
    from .launcher import launch
    from .trainer import run

    plan.validate()
    if type(steps) is not int or steps < 1 or type(micro_batch_size) is not int or micro_batch_size < 1:
        raise ValueError(f"--steps {steps} and --micro-batch-size {micro_batch_size} must be integers >= 1")
    if (plan.num_layers, plan.num_experts) != (model.num_layers, model.num_experts):
        raise ValueError(f"plan is for {plan.num_layers} layers x {plan.num_experts} experts but model {model.name!r} "
                         f"has {model.num_layers} x {model.num_experts}; make the plan with --model {model.name}")
    n_attn = len(plan.attention_ranks)
    gbs = micro_batch_size * plan.num_microbatches * n_attn
    ep = reference_ep(plan, model.num_experts)
    ref_cfg = TrainConfig(model, ParallelConfig(ep=ep), micro_batch_size=micro_batch_size, global_batch_size=gbs,
                          train_iters=steps, seed=seed, collect_grads=True, quiet=True, init_state=init_state)
    ref = run(ref_cfg, n_attn, timeout_s=timeout_s)
    het_cfg = TrainConfig(model, ParallelConfig(), micro_batch_size=micro_batch_size, global_batch_size=gbs,
                          train_iters=steps, seed=seed, collect_grads=True, quiet=True,
                          init_state=ref["initial_params"])
    het = launch(_hetero_rank, plan.world_size, het_cfg, plan, schedule, recompute, timeout_s=timeout_s)[0]

    loss_d = max(abs(a - b) / abs(b) for a, b in zip(het["losses"], ref["losses"]))
    by_cat: dict[str, float] = {}
    for g_h, g_r in zip(het["grads"], ref["grads"]):
        if set(g_h) != set(g_r):
            raise AssertionError(f"gradient names differ: {sorted(set(g_h) ^ set(g_r))[:6]}")
        for k in g_r:
            c = category(k)
            by_cat[c] = max(by_cat.get(c, 0.0), rel_diff(g_h[k], g_r[k]))
    param_d = max(rel_diff(het["params"][k], ref["params"][k]) for k in ref["params"])
    return ParityReport(ref["losses"], het["losses"], loss_d, max(by_cat.values()), by_cat, param_d)


def _hetero_rank(rank, world, cfg, plan, schedule, recompute):
    from .hetero_trainer import train_hetero
    from .zebra import ZebraConfig

    return train_hetero(cfg, plan, schedule=schedule, zebra_config=ZebraConfig(recompute=recompute))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetermoe parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="plan JSON (hetermoe plan --even ... -o plan.json)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--schedule", choices=["distep", "zebra"], default=None, help="override the plan's schedule")
    p.add_argument("--recompute", action="store_true", help="zebra: recompute attention stages in backward")
    p.add_argument("--loss-tol", type=float, default=LOSS_TOL)
    p.add_argument("--grad-tol", type=float, default=GRAD_TOL)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    a = p.parse_args(argv)
    import megatron.core  # noqa: F401  - import once, then fork ranks

    try:  # input errors (plan, model, flags) are refused before any rank starts
        plan = HeteroPlan.load(a.plan)
        model = ModelConfig.load(a.model)
        r = run_parity(plan, model, a.steps, a.micro_batch_size, a.seed, schedule=a.schedule, recompute=a.recompute)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    ok = r.ok(a.loss_tol, a.grad_tol)
    if a.json:
        print(json.dumps({**r.__dict__, "ok": ok}))
    else:
        g = plan.groups[0]
        print(f"plan: {len(plan.groups)} ZP group(s) of {len(g.attention_ranks)} attention + "
              f"{len(g.expert_ranks)} expert ranks, R={plan.num_microbatches}, schedule "
              f"{a.schedule or plan.schedule}; reference: Megatron EP="
              f"{reference_ep(plan, model.num_experts)} on {len(plan.attention_ranks)} ranks")
        print(f"{'step':>4} {'megatron lm loss':>18} {'hetermoe lm loss':>18} {'rel diff':>10}")
        for i, (x, y) in enumerate(zip(r.ref_losses, r.het_losses), 1):
            print(f"{i:>4} {x:>18.10f} {y:>18.10f} {abs(x - y) / abs(x):>10.2e}")
        for c, d in sorted(r.grad_diff_by_category.items()):
            print(f"grad max rel diff [{c}]: {d:.2e}")
        print(f"final weights max rel diff: {r.max_rel_param_diff:.2e}")
        print(f"{'PASS' if ok else 'FAIL'} max_rel_loss_diff={r.max_rel_loss_diff:.3e} "
              f"max_rel_grad_diff={r.max_rel_grad_diff:.3e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
