"""Multi-token prediction layers in a plan (issue 27 item 4): the MTP layers are the model layers
after the decoder's (`mtp_layers`), MoE layers placed like the others unless the decoder's last
layer, whose spec Megatron gives them, is dense."""
from __future__ import annotations

import pytest
import torch

from megatron_hetermoe.layer_pattern import model_dense_layers
from megatron_hetermoe.plan import expert_names as en
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan
from megatron_hetermoe.plan.layout import hetero_to_megatron, megatron_to_hetero


def test_mtp_layers_are_dense_exactly_when_the_last_decoder_layer_is():
    assert model_dense_layers(1, 2, 1) == []
    assert model_dense_layers(1, 2, None) == []
    assert model_dense_layers("([0]+[1]*2)", 3, 2) == [0]  # DeepSeek-V3: first-k dense, MoE MTP layers
    assert model_dense_layers(2, 4, 1) == [1, 3, 4]  # the last decoder layer dense: so is the MTP layer


def test_plan_counts_mtp_layers_after_the_decoder():
    plan = even_plan(3, 4, 1, 1, mtp_layers=1)
    assert (plan.num_layers, plan.model_layers, plan.decoder_layers, plan.moe_layer_ids) == (3, 3, 2, [0, 1, 2])
    again = HeteroPlan.from_dict(plan.to_dict())
    assert again.mtp_layers == 1 and again.to_dict() == plan.to_dict()
    assert "mtp_layers" not in even_plan(2, 4, 1, 1).to_dict()  # plans without MTP read as before
    plan.mtp_layers = 3
    with pytest.raises(PlanError, match=r"mtp_layers=3 must be an integer from 0 .* to 2 \(the model has 3 layers\)"):
        plan.validate()
    plan.mtp_layers = True  # JSON's true is not 1
    with pytest.raises(PlanError, match="mtp_layers=True"):
        plan.validate()


def test_job_with_other_mtp_layers_is_refused():
    from megatron_hetermoe.config import PoolPrecision
    from megatron_hetermoe.training.validation import check_plan_for_job

    fp32 = PoolPrecision("fp32", "fp32")
    plan = even_plan(3, 4, 1, 1, mtp_layers=1)
    check_plan_for_job(plan, 2, 2, 4, 1, 1, fp32, "m", "fix", mtp_num_layers=1)
    with pytest.raises(PlanError) as e:
        check_plan_for_job(plan, 2, 3, 4, 1, 1, fp32, "--num-layers 3", "remake it")
    assert str(e.value) == ("plan is for 2 layers + 1 MTP layers x 4 experts but --num-layers 3 has 3 layers x 4 "
                            "experts; remake it")


def test_mtp_experts_are_sliced_and_merged_by_the_plan():
    """A plain Megatron state with MTP layer 0's experts (model layer 2 of the plan) -> each rank's
    local slice -> back, every expert where its id says."""
    plan = even_plan(3, 4, 1, 2, mtp_layers=1)
    g = plan.groups[0]
    g.placement[2] = {0: [3], 1: [0, 2], 2: [1]}  # the attention rank holds an MTP expert (Asym-EA)
    plan.validate()
    state = {}
    for e in range(4):
        state[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.full((2, 2), 10.0 + e)
        state[f"mtp.layers.0.transformer_layer.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.full(
            (2, 2), 20.0 + e)
    state["mtp.layers.0.eh_proj.weight"] = torch.zeros(2, 4)
    per_rank = [megatron_to_hetero(state, plan, r) for r in range(3)]
    assert set(per_rank[0]) == {"mtp.layers.0.transformer_layer.mlp.experts.local_experts.0.linear_fc1.weight",
                                "mtp.layers.0.eh_proj.weight"}
    assert per_rank[0]["mtp.layers.0.transformer_layer.mlp.experts.local_experts.0.linear_fc1.weight"][0, 0] == 23
    assert per_rank[1]["mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc1.weight"][0, 0] == 22
    back = hetero_to_megatron(per_rank, plan)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert en.model_layer_of_prefix("mtp.layers.0.transformer_layer.mlp.experts.", 2) == 2
    assert en.model_layer_of_prefix("module.decoder.layers.1.mlp.experts.", 2) == 1


def test_the_expert_mirror_serves_the_mtp_layers_too():
    """One stage, no virtual stages: the DistEP mirror's one chunk is every MoE layer, the MTP
    layer's included (MoE index 2 here)."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = even_plan(3, 4, 1, 1, mtp_layers=1)
    assert plan.chunk_moe_layers(0, 0) == plan.stage_moe_layers(0) == [0, 1, 2]
