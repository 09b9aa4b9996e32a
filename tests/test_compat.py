"""compat.py: one layer spec form on megatron-core 0.16.1 .. 0.19.x (make compat runs 0.19)."""
import functools
import subprocess
import sys

import pytest
import torch

from megatron_hetermoe import compat
from megatron_hetermoe.config import ParallelConfig
from megatron_hetermoe.models.builder import layer_spec, transformer_config


def test_version_is_the_imported_megatron_core():
    from megatron.core import package_info

    assert compat.mcore_version() == (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    assert compat.is_supported()
    assert not compat.is_supported((0, 15, 3)) and not compat.is_supported((0, 20, 0))


def test_layer_spec_has_one_form_on_every_version(tiny):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = layer_spec(tiny).submodules.mlp
    assert isinstance(mlp, ModuleSpec) and mlp.module is MoELayer
    assert isinstance(mlp.submodules.experts, ModuleSpec) and mlp.submodules.experts.module is SequentialMLP
    assert compat.moe_experts_spec(layer_spec(tiny)) is not None


def test_builders_become_module_specs():
    """0.18+'s builder form, made here with this version's classes, normalizes to 0.16.1's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    base = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    native = base.submodules.mlp
    experts_sub = (native.keywords["submodules"].experts.keywords["submodules"]
                   if isinstance(native, functools.partial) else native.submodules.experts.submodules)
    router = native.keywords["submodules"].router if isinstance(native, functools.partial) else native.submodules.router
    base.submodules.mlp = functools.partial(MoELayer, submodules=MoESubmodules(
        router=router, experts=functools.partial(SequentialMLP, submodules=experts_sub)))
    spec = compat.normalize_layer_spec(base)
    assert spec is not base and isinstance(base.submodules.mlp, functools.partial)  # the input is left alone
    mlp = spec.submodules.mlp
    assert isinstance(mlp, ModuleSpec) and mlp.module is MoELayer and mlp.params == {}
    assert isinstance(mlp.submodules.experts, ModuleSpec) and mlp.submodules.experts.submodules is experts_sub
    assert compat.normalize_layer_spec(spec) is spec  # already normalized: identity
    with pytest.raises(TypeError, match="positional"):
        compat._builder_to_spec(functools.partial(SequentialMLP, 4))


def test_set_moe_layer_params_per_version(tiny):
    import copy

    class Layer:  # stands in for HeteroMoELayer
        pass

    spec = copy.deepcopy(layer_spec(tiny))
    compat.set_moe_layer(spec, Layer, pg_collection="PGC", hetero_state="HS")
    mlp = spec.submodules.mlp
    assert mlp.module is Layer and mlp.params["hetero_state"] == "HS"
    # 0.18+ TransformerLayers pass pg_collection themselves: giving it twice is a TypeError.
    assert ("pg_collection" in mlp.params) == (not compat.transformer_layer_passes_pg_collection())
    spec.submodules.mlp = functools.partial(Layer)
    with pytest.raises(TypeError, match="normalize_layer_spec"):
        compat.set_moe_layer(spec, Layer)


def test_build_experts_and_permute(tiny):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    created = not dist.is_initialized()
    if created:  # a one-rank world for this test only (forked ranks of later tests must not inherit it)
        import tempfile

        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    try:
        one = dist.new_group([0])
        pgc = ProcessGroupCollection(tp=one, ep=one, expt_tp=one, tp_ep=one, expt_dp=one)
        ps._set_global_memory_buffer()
        config = transformer_config(tiny, ParallelConfig())
        experts = compat.build_experts(compat.moe_experts_spec(layer_spec(tiny)), 2, config, pgc)
        assert len(experts.local_experts) == 2
    finally:
        ps.destroy_global_memory_buffer()
        if created:
            dist.destroy_process_group()
    tokens = torch.arange(12.0).view(4, 3)
    routing = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=torch.bool)
    permuted, probs, idx = compat.permute(tokens, routing, num_out_tokens=4)
    assert probs is None and idx.tolist() == [0, 2, 1, 2]
    assert torch.equal(permuted, tokens[[0, 2, 1, 2]])


def test_router_without_transformer_engine_gets_te_general_gemm_bound():
    # megatron-core < 0.17 leaves te_general_gemm unbound without transformer-engine (NameError in
    # the router, on CPU and GPU: seen on an H200); shims/moe_utils.py binds it. The subprocess shows the
    # upstream state first, so a release that fixes it is noticed.
    code = ("from megatron.core.transformer.moe import moe_utils as m; before = hasattr(m, 'te_general_gemm'); "
            "from megatron_hetermoe.compat import mcore_version as v; "
            "from megatron_hetermoe.shims.moe_utils import bind_missing_te_general_gemm as f; f(); "
            "print(before, m.te_general_gemm is None or callable(m.te_general_gemm), v() >= (0, 17, 0))")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    before, bound, fixed_upstream = out.stdout.split()
    assert bound == "True", out.stderr[-2000:]
    assert before == fixed_upstream, (f"upstream binding {before} on a release where it is "
                                      f"{'' if fixed_upstream == 'True' else 'not '}expected")
