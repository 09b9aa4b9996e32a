"""ModelConfig's parameter counts are what megatron-core builds (issue 42 item 1): a tiny GPTModel of
each shape on CPU, megatron-core 0.16.1's local spec, against ModelConfig.total_params(); and
hand-counted layers of the flagship models (their published sizes to the shown digits)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_hetermoe.config import ModelConfig

BASE = dict(name="t", num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, moe_ffn_hidden_size=32,
            num_experts=8, moe_router_topk=2, vocab_size=256, seq_length=32)
SHAPES = {
    "plugin": {},  # the plugin's Mixtral-style model: every default
    "qwen3": dict(kv_channels=32, num_query_groups=2, qk_layernorm=True),  # 4 x 32 != 64: Qwen3's case
    "gpt-oss": dict(kv_channels=8, num_query_groups=2, mlp_activation="quick-geglu", softmax_type="learnable",
                    window_size=(8, 0), window_attn_skip_freq=2, add_bias_linear=True),
    "deepseek-v3": dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                        qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, moe_layer_freq="([0]+[1]*2)",
                        moe_shared_expert_intermediate_size=48, mtp_num_layers=1, moe_router_num_groups=4,
                        moe_router_group_topk=2),
    "deepseek-v2-lite": dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                             v_head_dim=8, qk_layernorm=True, moe_layer_freq="([0]+[1]*2)",
                             moe_shared_expert_intermediate_size=48),
    "megatron-defaults": dict(mlp_activation="gelu", normalization="LayerNorm", add_bias_linear=True,
                              untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
                              max_position_embeddings=40, attention_output_gate=True),
    "squared-relu-qkv-bias": dict(mlp_activation="squared-relu", add_qkv_bias=True, num_query_groups=1),
    "shared-gate-mtp-dense-last": dict(moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
                                       normalization="LayerNorm", moe_layer_freq="([1]*2+[0])", mtp_num_layers=2),
}


def _megatron_counts(rank: int, world: int, shapes: dict) -> dict[str, int]:
    """megatron_core_params of every shape, in a launched rank: megatron-core's global groups never
    live in the pytest process (a world made and destroyed there leaves later tests' forked ranks
    hanging)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetermoe.shims.moe_utils import bind_missing_te_general_gemm

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    bind_missing_te_general_gemm()
    return {name: megatron_core_params(ModelConfig(**{**BASE, **shape})) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def megatron_counts() -> dict[str, int]:
    from megatron_hetermoe.parallel.launcher import launch

    return launch(_megatron_counts, 1, SHAPES, timeout_s=600)[0]


class _CoreWithKChannels(torch.nn.Module):
    """An attention core without parameters that takes MLA's k_channels/v_channels: megatron-core
    0.16.1's local MLA spec hands DotProductAttention (which has no parameters with the vanilla
    softmax) k_channels it does not take, so MLA does not build on CPU as shipped."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kw):
        super().__init__()


def megatron_core_params(m: ModelConfig) -> int:
    """Parameters of megatron-core's GPTModel of `m` (local spec, Megatron-LM's mapping of its flags:
    core_transformer_config_from_args, gpt_builders)."""
    from megatron.core.activations import quick_gelu, squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    act, gated = {"swiglu": (F.silu, True), "quick-geglu": (quick_gelu, True), "gelu": (F.gelu, False),
                  "squared-relu": (squared_relu, False)}[m.mlp_activation]
    kw = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
              ffn_hidden_size=m.ffn_hidden_size, num_moe_experts=m.num_experts,
              moe_ffn_hidden_size=m.moe_ffn_hidden_size,
              moe_router_topk=m.moe_router_topk, moe_layer_freq=m.moe_layer_freq,
              moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
              moe_shared_expert_gate=m.moe_shared_expert_gate, mtp_num_layers=m.mtp_num_layers,
              kv_channels=m.kv_channels, num_query_groups=m.num_query_groups, qk_layernorm=m.qk_layernorm,
              attention_output_gate=m.attention_output_gate, softmax_type=m.softmax_type,
              window_size=tuple(m.window_size) if m.window_size else None,
              window_attn_skip_freq=m.window_attn_skip_freq,
              normalization=m.normalization, add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias,
              activation_func=act, gated_linear_unit=gated, moe_router_num_groups=m.moe_router_num_groups,
              moe_router_group_topk=m.moe_router_group_topk, use_cpu_initialization=True, hidden_dropout=0.0,
              attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
              persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
              bias_dropout_fusion=False)
    cls = TransformerConfig
    if m.multi_latent_attention:
        cls = MLATransformerConfig
        kw.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                  rope_type="rope")
        # transformer-engine's names are placeholders on CPU: MLA's isinstance(linear_proj, TELinear) fails
        # (set in the launched rank, which ends after the counts)
        multi_latent_attention.HAVE_TE = False
    config = cls(**kw)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m.normalization)
    if m.multi_latent_attention:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _CoreWithKChannels
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if m.mtp_num_layers else None
    model = GPTModel(config, spec, m.vocab_size, m.max_position_embeddings or m.seq_length, mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                     position_embedding_type=m.position_embedding_type)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_param_count_is_what_megatron_core_builds(shape, megatron_counts):
    m = ModelConfig(**{**BASE, **SHAPES[shape]})
    assert m.total_params() == megatron_counts[shape]


def test_flagship_layers_by_hand():
    """Per-layer attention of Qwen3-30B-A3B (GQA, 32 x 128 != 2048) and DeepSeek-V3 (MLA), counted
    by hand from megatron-core's modules, and the models' published sizes."""
    qwen = ModelConfig(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_attention_heads=32,
                       ffn_hidden_size=6144, moe_ffn_hidden_size=768, num_experts=128, moe_router_topk=8,
                       vocab_size=151936, kv_channels=128, num_query_groups=4, qk_layernorm=True)
    # QKV 2048 x (32 + 2 x 4) x 128 = 2048 x 5120; proj 4096 x 2048; q and k norms 128 each
    assert qwen.attention_params() == 2048 * 5120 + 4096 * 2048 + 2 * 128 == 18_874_624
    assert round(qwen.total_params() / 1e9, 1) == 30.5  # "30.5B"
    dsv3 = ModelConfig(name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128,
                       ffn_hidden_size=18432, moe_ffn_hidden_size=2048, num_experts=256, moe_router_topk=8,
                       vocab_size=129280, moe_layer_freq="[0]*3+[1]*58", moe_shared_expert_intermediate_size=2048,
                       multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                       qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True)
    # q down 7168 x 1536, q up 1536 x 128 x (128 + 64), kv down 7168 x (512 + 64), kv up 512 x 128 x (128 + 128),
    # proj 128 x 128 x 7168, q and kv latent norms 1536 + 512
    assert dsv3.attention_params() == 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512 + 2048
    assert dsv3.attention_params() == 187_107_328
    assert round(dsv3.total_params() / 1e9) == 671  # "671B"
    # one MTP layer: its MoE layer and 2h x h projection, three norms (the 14B of the 685B checkpoint less its
    # embedding and head copies, which Megatron shares)
    mtp = dsv3.replace(mtp_num_layers=1).total_params() - dsv3.total_params()
    assert mtp == (dsv3.moe_layer_non_expert_params() + 256 * dsv3.expert_params() + 2 * 7168 ** 2 + 3 * 7168)
