"""The decoder's final norm follows the rank's kernels (models.builder.block_spec). Given a layer
spec alone, megatron-core's TransformerBlock takes its final norm from what imports: TENorm whenever
transformer-engine imports (on a V100, or a run on the local spec), else apex's FusedLayerNorm
(which refuses RMSNorm), else torch's. Here a GPU host's imports are simulated by setting that
choice to a stand-in."""
from __future__ import annotations

import torch
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.transformer import transformer_block

from megatron_hetermoe.config import ParallelConfig
from megatron_hetermoe.models import builder


class ImportedNorm(torch.nn.Module):
    """What TransformerBlock would take for the final norm where transformer-engine or apex imports."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))


def _final_norm_types(rank: int, world: int, tiny) -> tuple[type, type, int]:
    """In a launched rank (megatron-core's parallel state never lives in the pytest process, whose
    later tests fork their ranks: a world made and destroyed here left them hanging)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    transformer_block.LayerNormImpl = ImportedNorm  # what a GPU host's imports would give
    cfg = builder.transformer_config(tiny, ParallelConfig(), kernels="local")
    gpt = builder.build_gpt(tiny, cfg)
    return type(gpt.decoder.final_layernorm), type(gpt.decoder.layers[0].input_layernorm), len(gpt.decoder.layers)


def test_the_local_spec_s_final_norm_is_its_own_whatever_imports(tiny):
    from megatron_hetermoe.parallel.launcher import launch

    [(final, layer_norm, layers)] = launch(_final_norm_types, 1, tiny, timeout_s=300)
    assert final is torch.nn.RMSNorm  # the local spec's layers' norm
    assert layer_norm is torch.nn.RMSNorm
    assert layers == tiny.num_layers


def test_te_kernels_take_te_s_norm(tiny, monkeypatch):
    local = builder.layer_spec
    monkeypatch.setattr(builder, "layer_spec", lambda model, kernels: local(model, "local"))  # TE's needs TE
    cfg = builder.transformer_config(tiny, ParallelConfig(), kernels="local")
    assert builder.block_spec(tiny, "te_sequential", cfg).layer_norm is TENorm
    assert builder.block_spec(tiny, "local", cfg).layer_norm is local(tiny, "local").submodules.input_layernorm


def test_a_pipeline_stage_builds_its_own_layers(tiny):
    """As TransformerBlock counts them (get_num_layers_to_build) for the stage."""
    cfg = builder.transformer_config(tiny, ParallelConfig(pp=2), kernels="local")
    for stage in (0, 1):
        assert len(builder.block_spec(tiny, "local", cfg, pp_rank=stage).layer_specs) == tiny.num_layers // 2
