"""Dense layers in a plan (issue 27 item 2): Megatron's --moe-layer-freq read as Megatron reads it,
and a plan that counts MoE layers and names its dense ones by model index."""
from __future__ import annotations

import pytest

from megatron_hetermoe.layer_pattern import (
    LayerPatternError,
    dense_layers,
    moe_layer_pattern,
    parse_moe_layer_freq,
)
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan


@pytest.mark.parametrize("freq, layers, pattern", [
    (1, 3, [1, 1, 1]),
    (2, 5, [1, 0, 1, 0, 1]),  # Megatron: layer i is MoE when i % freq == 0
    ("3", 4, [1, 0, 0, 1]),
    ("([0]+[1]*2)", 3, [0, 1, 1]),  # DeepSeek-V2-Lite's form: first-k dense
    ("([1]*3+[0]*1)*2", 8, [1, 1, 1, 0, 1, 1, 1, 0]),  # Megatron-LM's own docstring example, repeated
    ([0, 1, 0, 1], 4, [0, 1, 0, 1]),
])
def test_pattern_as_megatron_reads_it(freq, layers, pattern):
    assert moe_layer_pattern(freq, layers) == pattern
    assert dense_layers(freq, layers) == [i for i, v in enumerate(pattern) if not v]


@pytest.mark.parametrize("freq, layers, words", [
    ("([0]+[1]*2)", 4, "need 4 entries"),
    ([1, 2], 2, "need 2 entries of 0"),
    (0, 2, "must be >= 1"),
    ("[0]*2", 2, "leaves no MoE layer"),
    ("__import__('os')", 2, "not an int nor a list expression"),
    ("[1]*[1]", 2, "not an int nor a list expression"),
    ("[1]*99999999", 2, "not an int nor a list expression"),
])
def test_bad_patterns_are_named(freq, layers, words):
    with pytest.raises(LayerPatternError, match=r".*") as e:
        dense_layers(freq, layers)
    assert words in str(e.value)


def test_parse_keeps_ints_and_lists():
    assert parse_moe_layer_freq("2") == 2 and parse_moe_layer_freq(2) == 2
    assert parse_moe_layer_freq(" ([0]+[1]) ") == [0, 1]


def test_plan_maps_model_layers_to_moe_layers():
    """4 model layers, dense 1 and 3: MoE layer k is model layer moe_layer_ids[k]; a name's layer
    index (model) finds its experts through local_experts_at; the JSON round-trips."""
    plan = even_plan(2, 4, 1, 1, dense_layers=[1, 3])
    assert (plan.num_layers, plan.model_layers, plan.moe_layer_ids) == (2, 4, [0, 2])
    assert [plan.moe_index(i) for i in range(4)] == [0, None, 1, None]
    assert plan.local_experts_at(1, 2) == plan.local_experts(1, 1) == [0, 1, 2, 3]
    with pytest.raises(PlanError, match="model layer 3 has experts here but is a dense layer"):
        plan.local_experts_at(1, 3)
    again = HeteroPlan.from_dict(plan.to_dict())
    assert again.dense_layers == [1, 3] and again.to_dict() == plan.to_dict()
    assert "dense_layers" not in even_plan(2, 4, 1, 1).to_dict()  # all-MoE plans read as before


@pytest.mark.parametrize("dense, words", [([4], "[4]: each must be a distinct model layer index in 0..2"),
                                          ([0, 0], "[0]: each must be a distinct"),
                                          (["1"], "must be a list of model layer indices")])
def test_bad_dense_layers_are_named(dense, words):
    plan = even_plan(2, 4, 1, 1)
    plan.dense_layers = dense
    with pytest.raises(PlanError) as e:
        plan.validate()
    assert words in str(e.value)


def test_job_with_other_dense_layers_is_refused():
    """The plan against a run's --num-layers/--moe-layer-freq (both hostings share the check)."""
    from megatron_hetermoe.config import PoolPrecision
    from megatron_hetermoe.training.validation import check_plan_for_job

    plan = even_plan(2, 4, 1, 1, dense_layers=[0])
    check_plan_for_job(plan, 2, 3, 4, 1, 1, PoolPrecision("fp32", "fp32"), "m", "fix", moe_layer_freq="([0]+[1]*2)")
    with pytest.raises(PlanError) as e:
        check_plan_for_job(plan, 2, 3, 4, 1, 1, PoolPrecision("fp32", "fp32"), "--num-layers 3", "remake it",
                           moe_layer_freq=2)
    assert str(e.value) == ("plan is for 3 layers (dense: [0]) x 4 experts but --num-layers 3 has 3 layers (dense: "
                            "[1]) x 4 experts; remake it")


@pytest.mark.parametrize("name, words", [("tiny-dense", "has dense layers"), ("dsv2-lite", "shared experts")])
def test_plugin_trainer_refuses_models_it_would_build_wrong(name, words):
    """The plugin's own trainer builds every layer as MoE: a model config with dense layers or
    shared experts is refused at launch (it would train another model than the plan's), naming
    the path that trains it."""
    from megatron_hetermoe.config import ModelConfig
    from megatron_hetermoe.training.validation import ConfigError, check_plugin_model

    with pytest.raises(ConfigError) as e:
        check_plugin_model(ModelConfig.load(name))
    assert words in str(e.value) and "pretrain_gpt.py and --hetero-plan" in str(e.value)
    check_plugin_model(ModelConfig.load("tiny"))


def test_emulated_bench_refuses_models_it_would_build_wrong(capsys):
    """The emulated bench and the emulator train on the plugin's own trainer: a model with dense
    layers is refused by name before any rank starts (the emulator's EP hooks count every layer)."""
    from megatron_hetermoe.config import EmulationSpec
    from megatron_hetermoe.emulation.emulator import Emulator
    from megatron_hetermoe.tools.bench import main

    with pytest.raises(SystemExit):
        main(["--cluster", "mini-2a40-2v100", "--model", "tiny-dense", "--seq-len", "32"])
    assert "--model tiny-dense: has dense layers [0]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="emulated model 'tiny-dense' has dense layers"):
        Emulator(EmulationSpec(cluster="mini-2a40-2v100", model="tiny-dense", seq_len=32, global_batch=4))


def test_block_spec_must_have_the_plans_dense_layers():
    """Megatron's decoder block spec for --moe-layer-freq 2 (4 layers: MoE 0 and 2) against plans:
    the same pattern passes and gets HeteroMoELayer in exactly its MoE layers; another pattern, or
    one layer spec for a plan with dense layers, is refused naming both."""
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_hetermoe.config import ModelConfig, ParallelConfig
    from megatron_hetermoe.models.builder import layer_spec, transformer_config
    from megatron_hetermoe.models.moe_layer import (
        HeteroMoELayer,
        hetero_block_spec,
        is_moe_layer_spec,
    )

    tiny = ModelConfig.load("tiny")
    config = transformer_config(tiny.replace(num_layers=4), ParallelConfig(), moe_layer_freq=2)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    assert [is_moe_layer_spec(s) for s in block.layer_specs] == [True, False, True, False]
    hs = types.SimpleNamespace(plan=even_plan(2, 4, 1, 1, dense_layers=[1, 3]))
    out = hetero_block_spec(block, hs, None)
    assert [s.submodules.mlp.module is HeteroMoELayer for s in out.layer_specs] == [True, False, True, False]
    hs.plan = even_plan(2, 4, 1, 1, dense_layers=[0, 1])
    with pytest.raises(ValueError, match=r"MoE layers \[0, 2\] of 4 are not the plan's \[2, 3\] of 4"):
        hetero_block_spec(block, hs, None)
    with pytest.raises(ValueError, match="one layer spec for every layer"):
        hetero_block_spec(layer_spec(tiny), hs, None)
