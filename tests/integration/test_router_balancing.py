"""Router load balancing in the plugin's trainer, against Megatron EP: aux-loss-free balancing
(Megatron's router expert bias), whose update sums the token counts over every attention rank that
routes as Megatron EP sums over its tensor x data group, so HeterMoE's losses and every replica's
expert_bias are Megatron EP's; and DeepSeek-V2's per-sequence loss (seq_aux_loss)."""
import dataclasses

import pytest
from margins import within

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.tools.parity import (
    GRAD_NORM_TOL,
    GRAD_TOL,
    LOSS_TOL,
    max_rel_loss_diff,
    reference_ep,
    run_parity,
)
from megatron_hetermoe.training.run_hooks import RunHooks

STEPS = 3  # odd: a bias moved by +-rate every step cannot be back at 0


def _megatron_ep(rank, world, cfg, hooks):
    from megatron_hetermoe.training.megatron_ep import train

    return train(cfg, hooks)


def _hetero(rank, world, cfg, plan, hooks):
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, HeteroRunConfig(), hooks)


def _aux_free(tiny, rate):
    return tiny.replace(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate)


@pytest.mark.parametrize("M, N, G", [(2, 2, 1), pytest.param(1, 1, 2, marks=pytest.mark.slow)], ids=["2+2", "2x(1+1)"])
def test_expert_bias_matches_megatron_ep(tiny, M, N, G):
    # A rate far above Megatron's 1e-3, so the bias changes the tiny model's routing within the run
    # (the losses then check that HeterMoE routes with the bias Megatron EP has); M x G = 2 attention
    # ranks route, in one ZP group or in two.
    model = _aux_free(tiny, 0.05)
    plan = even_plan(model.num_layers, model.num_experts, M, N, groups=G, num_microbatches=2, schedule="zebra")
    n_attn = len(plan.attention_ranks)
    cfg = TrainConfig(model, ParallelConfig(), micro_batch_size=1, global_batch_size=2 * n_attn, train_iters=STEPS,
                      quiet=True)
    ref_cfg = dataclasses.replace(cfg, parallel=ParallelConfig(ep=reference_ep(plan, model.num_experts)))
    ref = launch(_megatron_ep, n_attn, ref_cfg, RunHooks(collect_grads=True))
    # At the reference's parameters of each step (tools/parity.py): the expert bias is a buffer, each
    # side updates its own from its own routing.
    pinned = RunHooks(init_state=ref[0].initial_params, pin_params=ref[0].step_params)
    het = launch(_hetero, plan.world_size, cfg, plan, pinned)
    within("loss", max_rel_loss_diff(het[0].losses, ref[0].losses), LOSS_TOL)

    want = ref[0].router_expert_bias
    assert sorted(want) == [f"decoder.layers.{i}.mlp.router.expert_bias" for i in range(model.num_layers)]
    assert all(r.router_expert_bias == want for r in ref)  # Megatron EP's replicas agree
    moved = {round(abs(b), 6) for bias in want.values() for b in bias}
    assert moved - {0.0}, f"no expert bias moved in {STEPS} steps: {want}"
    for r in plan.attention_ranks:
        assert het[r].router_expert_bias == want, (r, het[r].router_expert_bias, want)
    for r in plan.expert_ranks:
        assert het[r].router_expert_bias == {}


@pytest.mark.slow
def test_aux_loss_free_changes_routing(tiny):
    # The bias reaches the routing: the same run without it trains otherwise (so the test above can
    # tell a bias that never moved, or moved apart, from Megatron EP's).
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    runs = []
    for rate in (0.0, 0.05):
        cfg = TrainConfig(_aux_free(tiny, rate), ParallelConfig(), micro_batch_size=1, global_batch_size=4,
                          train_iters=STEPS, quiet=True)
        runs.append(launch(_hetero, plan.world_size, cfg, plan, RunHooks())[0].losses)
    assert runs[0][0] == runs[1][0]  # the first step routes with a zero bias on both
    assert runs[0][1:] != runs[1][1:], runs


@pytest.mark.slow
def test_seq_aux_loss_matches_megatron_ep(tiny):
    # Measured (2+2, R 2, 3 steps): losses equal, gradients 1.8e-7 (the router's): >= 50x inside.
    model = tiny.replace(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)
    plan = even_plan(model.num_layers, model.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    r = run_parity(plan, model, steps=3, micro_batch_size=2, free_run=False)
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)
