"""The layout-invariant initialization follows Megatron's init flags (issue 24 item 12): each
parameter gets the init method Megatron's TransformerConfig holds for its kind."""
from __future__ import annotations

import dataclasses
import math

import torch

from megatron_hetermoe.config import ParallelConfig
from megatron_hetermoe.models.builder import canonical_init, transformer_config

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.1.self_attention.linear_proj.weight"
FC2 = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
ROUTER = "decoder.layers.0.mlp.router.weight"
EMB = "embedding.word_embeddings.weight"
NORM = "decoder.layers.0.input_layernorm.weight"


def _config(tiny, **kw):
    """The plugin's config for `tiny` with Megatron's init fields `kw`; the init methods Megatron
    derives from them (TransformerConfig.__post_init__) are derived again."""
    derived = {"init_method": None, "output_layer_init_method": None, "embedding_init_method": None,
               "embedding_init_method_std": None}
    return dataclasses.replace(transformer_config(tiny, ParallelConfig(), "fp32", kernels="local"), **{**derived, **kw})


def _init(name, config, shape=(256, 128)):
    return canonical_init(name, torch.Size(shape), 1234, config)


def test_default_is_megatrons_normal_init(tiny):
    c = _config(tiny)
    for name in (QKV, ROUTER, EMB):
        assert abs(_init(name, c).std().item() - 0.02) < 0.002, name
    out_std = 0.02 / math.sqrt(2 * tiny.num_layers)  # scaled_init_method_normal
    for name in (PROJ, FC2):
        assert abs(_init(name, c).std().item() - out_std) < 0.1 * out_std, name
    assert torch.equal(_init(NORM, c, (128,)), torch.ones(128))
    assert torch.equal(_init(QKV, c), _init(QKV, c))  # the same values wherever the parameter lives
    assert not torch.equal(_init(QKV, c), _init(PROJ, c))


def test_init_method_std_scales_every_normal_weight(tiny):
    base, wide = _config(tiny), _config(tiny, init_method_std=0.05)
    for name in (QKV, PROJ, FC2, EMB):
        assert torch.allclose(_init(name, wide), _init(name, base) * 2.5, rtol=1e-6, atol=0), name


def test_xavier_uniform(tiny):
    """--init-method-xavier-uniform: Megatron sets init_method and the scaled (output) init method to
    torch's xavier_uniform_, and the embedding follows init_method."""
    c = _config(tiny, init_method=torch.nn.init.xavier_uniform_,
                output_layer_init_method=torch.nn.init.xavier_uniform_)
    bound = math.sqrt(6 / (256 + 128))
    for name in (QKV, PROJ, FC2, ROUTER, EMB):
        w = _init(name, c)
        assert 0.95 * bound < w.abs().max().item() <= bound, name  # uniform on [-bound, bound]
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.05 * bound, name
        assert torch.equal(w, _init(name, c))
    assert not torch.equal(_init(QKV, c), _init(QKV, _config(tiny)))


def test_embedding_init_method_std(tiny):
    c = _config(tiny, embedding_init_method_std=0.5)
    assert abs(_init(EMB, c).std().item() - 0.5) < 0.05
    assert abs(_init("embedding.position_embeddings.weight", c).std().item() - 0.5) < 0.05
    assert abs(_init(QKV, c).std().item() - 0.02) < 0.002  # the others keep --init-method-std


def test_apply_layernorm_1p_starts_norms_at_zero(tiny):
    """--apply-layernorm-1p (zero-centered gamma): the norm computes with weight + 1, so Megatron
    starts its weights at 0."""
    c = _config(tiny, layernorm_zero_centered_gamma=True)
    assert torch.equal(_init(NORM, c, (128,)), torch.zeros(128))
    assert torch.equal(_init("decoder.final_layernorm.weight", c, (128,)), torch.zeros(128))


def test_biases_start_as_megatrons(tiny):
    """--add-bias-linear (Megatron's default): linear layers' and norms' biases start at 0, the
    router's bias by init_method (megatron-core's TopKRouter draws it like its weight)."""
    c = _config(tiny)
    for name in ("decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.1.self_attention.linear_proj.bias",
                 "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.bias", FC2.replace("weight", "bias"),
                 "decoder.layers.0.input_layernorm.bias"):
        assert torch.equal(_init(name, c, (128,)), torch.zeros(128)), name
    bias = _init("decoder.layers.0.mlp.router.bias", c, (4096,))
    assert abs(bias.std().item() - 0.02) < 0.002 and torch.equal(bias, _init("decoder.layers.0.mlp.router.bias", c,
                                                                             (4096,)))
