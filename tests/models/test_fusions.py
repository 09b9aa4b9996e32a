"""Megatron's fusions (issue 43 item 8): Megatron-LM's defaults on GPU ranks, each turned off only
where the rank cannot run it, for the reason its row of models.builder.FUSION_RULES gives; CPU
ranks run none, so the CPU configs (and the parity suite's numbers) are what they were. The CUDA
ranks here are described, not present: their capability and what imports are injected."""
from __future__ import annotations

import pytest

from megatron_hetermoe.config import ModelConfig, ParallelConfig
from megatron_hetermoe.models import builder
from megatron_hetermoe.models.builder import FUSION_RULES, NO_FUSIONS, Fusion, RankEnv, choose_fusions

F = Fusion
MEGATRON_LM_ON = {F.BIAS_ACTIVATION, F.MASKED_SOFTMAX, F.PERSIST_LAYER_NORM, F.GRADIENT_ACCUMULATION, F.APPLY_ROPE,
                  F.BIAS_DROPOUT}  # Megatron-LM's flags' defaults; moe_permute and cross-entropy are off there
EVERYTHING = dict(te=True, te_grouped=True, te_why="transformer-engine 2.4", te_rope=True, te_permute=True,
                  apex_norm=True, apex_wgrad=True, softmax_kernels=True, jit_fuser_builds=True)


def h100(**kw) -> RankEnv:
    return RankEnv("cuda", 0, "NVIDIA H100 80GB HBM3", (9, 0), **{**EVERYTHING, **kw})


def bare(**kw) -> RankEnv:
    """A CUDA rank where none of the optional kernels import (torch and megatron-core alone)."""
    return RankEnv("cuda", 0, "NVIDIA H100 80GB HBM3", (9, 0), te_why="transformer_engine does not import", **kw)


def on(choice) -> set:
    return {f for f, v in choice.on.items() if v}


def test_megatron_lm_defaults_are_the_table_s():
    assert {f for f, r in FUSION_RULES.items() if r.megatron_lm} == MEGATRON_LM_ON
    assert set(FUSION_RULES) == set(Fusion)


def test_the_cpu_config_is_unchanged(tiny):
    """CPU ranks: every fusion off, as transformer_config has always built them."""
    cpu = choose_fusions(RankEnv("cpu"), "local", "attention")
    assert not on(cpu) and set(cpu.off) == MEGATRON_LM_ON and all("CPU rank" in w for w in cpu.off.values())
    assert cpu.config_kwargs() == NO_FUSIONS.config_kwargs() == {f.value: False for f in Fusion}
    for fusions in (None, cpu):
        cfg = builder.transformer_config(tiny, ParallelConfig(), "fp32", "local", fusions=fusions)
        assert {f.value: getattr(cfg, f.value) for f in Fusion} == {f.value: False for f in Fusion}


def test_a_gpu_with_everything_keeps_megatron_lm_s_defaults():
    for kernels in ("te", "te_sequential"):
        got = choose_fusions(h100(), kernels, "attention")
        assert on(got) == MEGATRON_LM_ON and not got.off, got
    got = choose_fusions(h100(), "local", "attention")  # RMSNorm on the local spec: torch's norm
    assert on(got) == MEGATRON_LM_ON - {F.PERSIST_LAYER_NORM}
    assert "WrappedTorchNorm" in got.off[F.PERSIST_LAYER_NORM]
    assert on(choose_fusions(h100(), "local", "attention", normalization="LayerNorm")) == MEGATRON_LM_ON  # apex's


@pytest.mark.parametrize("fusion, needs", [
    (F.BIAS_ACTIVATION, "triton"), (F.BIAS_DROPOUT, "triton"), (F.CROSS_ENTROPY_LOSS, "triton"),
    (F.MASKED_SOFTMAX, "scaled_masked_softmax_cuda"), (F.PERSIST_LAYER_NORM, "WrappedTorchNorm"),
    (F.GRADIENT_ACCUMULATION, "fused_weight_gradient_mlp_cuda"), (F.APPLY_ROPE, "transformer_engine does not import"),
    (F.MOE_PERMUTE, "transformer_engine does not import")])
def test_each_fusion_is_off_for_its_own_reason_where_its_kernel_is_missing(fusion, needs):
    asked = {f: True for f in Fusion}
    got = choose_fusions(bare(), "local", "attention", requested=asked)
    assert not got.on[fusion] and needs in got.off[fusion], got.off.get(fusion)
    # ... and on where just that kernel is there
    present = {F.BIAS_ACTIVATION: dict(jit_fuser_builds=True), F.BIAS_DROPOUT: dict(jit_fuser_builds=True),
               F.CROSS_ENTROPY_LOSS: dict(jit_fuser_builds=True), F.MASKED_SOFTMAX: dict(softmax_kernels=True),
               F.PERSIST_LAYER_NORM: dict(apex_norm=True), F.GRADIENT_ACCUMULATION: dict(apex_wgrad=True),
               F.APPLY_ROPE: dict(te=True, te_rope=True), F.MOE_PERMUTE: dict(te=True, te_permute=True)}[fusion]
    norm = "LayerNorm" if fusion is F.PERSIST_LAYER_NORM else "RMSNorm"
    assert choose_fusions(bare(**present), "local", "attention", norm, asked).on[fusion]


def test_a_v100_with_transformer_engine_installed_runs_none_of_its_fusions():
    v100 = RankEnv("cuda", 3, "Tesla V100-SXM2-16GB", (7, 0), **EVERYTHING)
    got = choose_fusions(v100, "local", "expert", requested={F.MOE_PERMUTE: True})
    for f in (F.APPLY_ROPE, F.MOE_PERMUTE):
        assert not got.on[f] and "rank 3 (Tesla V100-SXM2-16GB, compute capability 7.0)" in got.off[f], got.off
    assert got.on[F.GRADIENT_ACCUMULATION] and got.on[F.BIAS_ACTIVATION]  # apex and triton run on a V100


def test_te_experts_fuse_the_weight_gradient_without_apex():
    """An expert rank with TE experts has only TE's linears, which fuse it themselves; any rank with
    megatron-core's linears (GPTModel's output layer in every spec) needs apex's extension."""
    assert choose_fusions(bare(te=True), "te", "expert").on[F.GRADIENT_ACCUMULATION]
    assert not choose_fusions(bare(te=True), "te", "attention").on[F.GRADIENT_ACCUMULATION]
    assert not choose_fusions(bare(te=True), "local", "expert").on[F.GRADIENT_ACCUMULATION]


def test_flags_that_turn_a_fusion_off_keep_it_off_without_a_reason():
    asked = {F.BIAS_ACTIVATION: False, F.MOE_PERMUTE: True}
    got = choose_fusions(h100(), "te", "attention", requested=asked)
    assert not got.on[F.BIAS_ACTIVATION] and F.BIAS_ACTIVATION not in got.off
    assert got.on[F.MOE_PERMUTE]
    assert got.lines() == []
    assert choose_fusions(bare(), "local", "attention").lines()[0].startswith("bias_activation_fusion off: ")


def test_megatron_core_takes_a_gpu_rank_s_fusions(tiny):
    """The fusions a CUDA rank without transformer-engine runs make a TransformerConfig megatron-core
    accepts (its own checks of each fusion run in __post_init__)."""
    fusions = choose_fusions(bare(jit_fuser_builds=True, softmax_kernels=True, apex_wgrad=True), "local", "attention")
    assert on(fusions) == {F.BIAS_ACTIVATION, F.MASKED_SOFTMAX, F.GRADIENT_ACCUMULATION, F.BIAS_DROPOUT}
    cfg = builder.transformer_config(tiny, ParallelConfig(), "bf16", "local", fusions=fusions)
    assert (cfg.bias_activation_fusion, cfg.masked_softmax_fusion, cfg.gradient_accumulation_fusion,
            cfg.bias_dropout_fusion, cfg.apply_rope_fusion, cfg.persist_layer_norm) == (True, True, True, True, False,
                                                                                      False)


def test_tiny_model_normalization_is_the_table_s_default():
    """choose_fusions' default normalization is the one transformer_config builds."""
    assert builder.transformer_config(ModelConfig.load("tiny"), ParallelConfig()).normalization == "RMSNorm"
