"""A plan's expert_recompute 'keep-inputs' (the planner's default under activation checkpointing):
expert holders keep only their experts' inputs for backward and re-run the experts' forward there.
Parity with Megatron EP under every schedule, a unit check of what the experts keep, and the
refusal of the level the runtime does not run."""
import dataclasses

import pytest
import torch
from margins import within
from shared_plans import sparse_asym_ea_plan

from megatron_hetermoe.plan.hetero_plan import PlanError
from megatron_hetermoe.tools.parity import GRAD_NORM_TOL, GRAD_TOL, LOSS_TOL, run_parity


@pytest.mark.slow
@pytest.mark.parametrize("schedule, issuer", [("distep", "auto"), ("zebra", "threads"), ("zebra", "single")])
def test_keep_inputs_matches_megatron_ep(tiny, schedule, issuer):
    # 2 attention + 2 expert ranks, Asym-EA: experts on an attention rank recompute too.
    plan = dataclasses.replace(sparse_asym_ea_plan(schedule), expert_recompute="keep-inputs")
    r = run_parity(plan, tiny, steps=2, micro_batch_size=1, free_run=False, issuer=issuer)
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)


def _saved_bytes(fn) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = fn()
    return sum(saved), out


def test_keep_inputs_keeps_only_the_inputs_and_computes_the_same(tiny):
    from megatron_hetermoe.parallel.launcher import launch

    # A launched 1-rank child: the experts need process groups, which never live in pytest's process.
    [(kept_off, kept_rec, same)] = launch(_keep_inputs_case, 1, tiny, timeout_s=300)
    assert same, "recomputed experts differ from the kept ones"
    # What is kept: the experts' input (tokens and probabilities) and the host counts, no
    # intermediates (fc1's 2f outputs, the f-wide product).
    rows, h, f = 10, tiny.hidden_size, tiny.moe_ffn_hidden_size
    assert kept_rec <= rows * (h + 1) * 4 + 1024, (kept_rec, kept_off)
    assert kept_off >= rows * (h + 3 * f) * 4, (kept_rec, kept_off)


def _keep_inputs_case(rank, world, tiny):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import layer_spec, transformer_config
    from megatron_hetermoe.models.experts import build_experts, run_local_experts

    parallel_state.initialize_model_parallel(1, 1)
    cfg = transformer_config(tiny.replace(num_layers=1), ParallelConfig())
    spec = layer_spec(tiny).submodules.mlp.submodules.experts
    torch.manual_seed(0)
    experts = build_experts(cfg, spec, 2, ProcessGroupCollection.use_mpu_process_groups())
    counts = torch.tensor([[3, 2], [1, 4]])  # [source member, local expert]: 10 rows
    x = torch.randn(int(counts.sum()), tiny.hidden_size, requires_grad=True)
    results = {}
    for recompute in (False, True):
        x.grad = None
        experts.zero_grad(set_to_none=True)
        kept, y = _saved_bytes(lambda: run_local_experts(experts, x, counts, recompute=recompute))
        y.square().sum().backward()
        results[recompute] = (kept, y.detach(), x.grad.clone(), [p.grad.clone() for p in experts.parameters()])
    (kept_off, y0, gx0, gp0), (kept_rec, y1, gx1, gp1) = results[False], results[True]
    same = torch.equal(y0, y1) and torch.equal(gx0, gx1) and all(torch.equal(a, b) for a, b in zip(gp0, gp1))
    return kept_off, kept_rec, same


def test_a_resend_inputs_plan_is_refused_before_any_group(tiny):
    from megatron_hetermoe.parallel.launcher import LaunchError, launch

    plan = dataclasses.replace(sparse_asym_ea_plan("zebra"), expert_recompute="resend-inputs")
    plan.validate()  # a valid plan: the planner prices it
    with pytest.raises(LaunchError, match="expert_recompute='resend-inputs' is priced by the planner but not run"):
        launch(_init, 4, plan, timeout_s=120)


def _init(rank, world, plan):
    from megatron_hetermoe.parallel.state import initialize_hetero_parallel

    initialize_hetero_parallel(plan)


def test_plan_file_round_trip_and_refusal_of_unknown_levels(tiny):
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    plan = dataclasses.replace(sparse_asym_ea_plan("zebra"), expert_recompute="keep-inputs")
    assert HeteroPlan.from_dict(plan.to_dict()).expert_recompute == "keep-inputs"
    assert "expert_recompute" not in sparse_asym_ea_plan("zebra").to_dict()  # 'off' files read as before
    with pytest.raises(PlanError, match="expert_recompute='some' is unknown"):
        dataclasses.replace(plan, expert_recompute="some").validate()
