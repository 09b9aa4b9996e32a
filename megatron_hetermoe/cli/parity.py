"""`hetermoe parity`'s parser (behaviour and tolerances: tools/parity.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.config import ISSUERS

from megatron_hetermoe.cli.formatter import HelpFormatter
from megatron_hetermoe.plan.tasks import SCHEDULES


def build_parser(description: str, loss_tol: float, grad_tol: float, free_run_tol: float,
                 free_run_loss_tol: float) -> argparse.ArgumentParser:
    """The tolerances are the flags' defaults."""
    p = argparse.ArgumentParser(prog="hetermoe parity", description=description,
                                formatter_class=HelpFormatter)
    p.add_argument("--plan", required=True, help="plan JSON (hetermoe plan --even ... -o plan.json)")
    p.add_argument("--model", default="tiny", help="model config (a models/ name or a YAML path); the plan's shape")
    p.add_argument("--steps", type=int, default=5, help="training steps compared")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per microbatch per attention rank")
    p.add_argument("--seed", type=int, default=1234, help="seed of weights and data (both runs)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default=None,
                   help="override the plan's schedule (default: the plan's)")
    p.add_argument("--recompute", action="store_true", help="zebra: recompute attention stages in backward")
    p.add_argument("--zebra-issuer", choices=list(ISSUERS), default="auto",
                   help="zebra: who issues the transfers (--hetero-zebra-issuer's meaning; default: auto)")
    p.add_argument("--loss-tol", type=float, default=loss_tol, help="bound on max_rel_loss_diff (identical parameters)")
    p.add_argument("--grad-tol", type=float, default=grad_tol, help="bound on max_rel_grad_diff (identical parameters)")
    p.add_argument("--free-run-tol", type=float, default=free_run_tol,
                   help="bound on max_rel_param_diff_free_run (final weights of the free-running trajectories)")
    p.add_argument("--free-run-loss-tol", type=float, default=free_run_loss_tol,
                   help="bound on max_rel_loss_diff_free_run (losses of the free-running trajectories)")
    p.add_argument("--no-free-run", dest="free_run", action="store_false",
                   help="skip the free-running HeterMoE run (its final-weights difference is then not reported)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p
