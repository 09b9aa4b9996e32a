"""The decoder's final norm follows the rank's kernels (models.builder.block_spec). Given a layer
spec alone, megatron-core's TransformerBlock takes its final norm from what imports: TENorm whenever
transformer-engine imports (on a V100, or a run on the local spec), else apex's FusedLayerNorm
(which refuses RMSNorm), else torch's. Here a GPU host's imports are simulated by setting that
choice to a stand-in."""
from __future__ import annotations

import tempfile

import pytest
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


@pytest.fixture
def one_rank_megatron():
    """megatron-core's parallel state on a one-process gloo world (as Megatron EP's trainer has it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    ps.initialize_model_parallel()
    try:
        model_parallel_cuda_manual_seed(1)
        yield
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def test_the_local_spec_s_final_norm_is_its_own_whatever_imports(tiny, one_rank_megatron, monkeypatch):
    monkeypatch.setattr(transformer_block, "LayerNormImpl", ImportedNorm)
    cfg = builder.transformer_config(tiny, ParallelConfig(), kernels="local")
    gpt = builder.build_gpt(tiny, cfg)
    assert type(gpt.decoder.final_layernorm) is torch.nn.RMSNorm  # the local spec's layers' norm
    assert type(gpt.decoder.layers[0].input_layernorm) is torch.nn.RMSNorm
    assert len(gpt.decoder.layers) == tiny.num_layers


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
