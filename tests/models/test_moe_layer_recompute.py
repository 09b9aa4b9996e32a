"""Megatron's MoE-layer recomputation (--moe-layer-recompute, --recompute-modules moe) as HeterMoE
runs it: the experts keep their inputs and recompute their forward (models/experts.py
recomputes_experts, what the plan's expert_recompute 'keep-inputs' does; that it does keep only the
inputs is test_expert_recompute_runtime.py's). That HeteroMoELayer does not checkpoint
MoELayer.forward whole (which would replay the dispatch on the attention ranks alone: a DistEP run
would fail) is test_megatron_lm_pretrain.py's run with --moe-layer-recompute."""
from __future__ import annotations

import dataclasses

from megatron_hetermoe.config import ParallelConfig
from megatron_hetermoe.models.builder import transformer_config
from megatron_hetermoe.models.experts import recomputes_experts
from megatron_hetermoe.plan.hetero_plan import even_plan


def test_either_flag_or_the_plan_recomputes_the_experts(tiny):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 1)
    keep = dataclasses.replace(plan, expert_recompute="keep-inputs")
    par = ParallelConfig()
    plain = transformer_config(tiny, par)
    old_flag = transformer_config(tiny, par, moe_layer_recompute=True)  # megatron-core makes it selective "moe"
    modules = transformer_config(tiny, par, recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
    other = transformer_config(tiny, par, recompute_granularity="selective", recompute_modules=["core_attn"])
    assert not recomputes_experts(plain, plan) and not recomputes_experts(other, plan)
    assert recomputes_experts(old_flag, plan) and recomputes_experts(modules, plan)
    assert recomputes_experts(plain, keep)
