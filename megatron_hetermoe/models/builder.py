"""Build the Mixtral-style MoE GPTModel with megatron-core's local spec, and give it weights
that do not depend on the parallel layout (so any two layouts start identical)."""
from __future__ import annotations

import dataclasses
import re
import zlib

import torch
import torch.nn.functional as F

from megatron_hetermoe.config import ModelConfig, ParallelConfig

PRECISIONS = ("fp32", "bf16", "fp16")


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter and activation dtype of a precision name (TrainConfig.precision)."""
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r} is unknown; use one of {list(PRECISIONS)}") from None


def transformer_config(model: ModelConfig, par: ParallelConfig, precision: str = "fp32", **overrides):
    """megatron-core's TransformerConfig of `model`; `precision` sets bf16/fp16 and
    params_dtype as Megatron-LM's --bf16/--fp16 do."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = precision_dtype(precision)
    kw = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        # Megatron refuses top-1 with softmax after top-k (the gate would get no gradient).
        moe_router_pre_softmax=model.moe_router_topk == 1,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type=par.dispatcher,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        moe_permute_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    # megatron-core's default CUDA-graph scope "full" (cuda_graph_scope in 0.16-0.18,
    # cuda_graph_modules from 0.19) warns "full scope is deprecated" on every config; [] is
    # the same whole-layer scope without the warning. (Unused on CPU: no CUDA graphs.)
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    for name in ("cuda_graph_modules", "cuda_graph_scope"):
        if defaults.get(name) == "full":
            kw[name] = []
            break
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(model: ModelConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hetermoe.compat import (
        bind_missing_te_general_gemm,
        normalize_layer_spec,
    )

    bind_missing_te_general_gemm()  # the router needs it without transformer-engine (compat.py)
    # 0.18+ give the MoE mlp as builders; normalized to 0.16.1's ModuleSpec form (compat.py).
    return normalize_layer_spec(get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm"))


def build_gpt(model: ModelConfig, config, spec=None, pre_process: bool = True, post_process: bool = True,
              pg_collection=None, pp_rank: int | None = None):
    """One pipeline stage of the GPT model (all of it when PP=1)."""
    from megatron.core.models.gpt import GPTModel

    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    return GPTModel(
        config=config,
        transformer_layer_spec=spec if spec is not None else layer_spec(model),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        **kw,
    )


def wrap_precision(config, module: torch.nn.Module) -> torch.nn.Module:
    """Megatron-LM's get_model: a bf16/fp16 model chunk is wrapped in Float16Module (which
    casts it) before DDP; fp32 chunks are returned as they are."""
    if not (config.bf16 or config.fp16):
        return module
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, module)


def wrapped_names(model: torch.nn.Module, names: dict[str, str]) -> dict[str, str]:
    """`names` (the unwrapped module's local name -> canonical name) keyed by the names the
    wrapped model (DDP, Float16Module) gives the same parameters."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    by_param = {p: names[n] for n, p in inner.named_parameters()}
    return {n: by_param[p] for n, p in model.named_parameters()}


# --- canonical names: the same parameter has the same name in every layout -----------------
_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """local parameter name -> canonical name: the name in a plain Megatron model with PP=1 and
    EP=1 (global layer and expert indices, no DDP wrapper).

    Layer numbers come from TransformerLayer.layer_number (global, 1-based) and expert ids
    from MoELayer.local_expert_indices, so PP and EP shards map onto one namespace.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer_of: dict[int, int] = {}
    experts_of: dict[int, list[int]] = {}
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        m = re.match(r"^(?:module\.)*decoder\.layers\.(\d+)$", name)
        if m and isinstance(mod, TransformerLayer):
            layer_of[int(m.group(1))] = mod.layer_number - 1
            mlp = mod.mlp
            if hasattr(mlp, "local_expert_indices"):
                experts_of[int(m.group(1))] = list(mlp.local_expert_indices)
    out = {}
    for name, _ in model.named_parameters():
        canon = re.sub(r"^(?:module\.)*", "", name)
        m = _LAYER.match(name)
        if m:
            local = int(m.group(1))
            canon = _LAYER.sub(f"decoder.layers.{layer_of[local]}.", name)
            e = _EXPERT.search(canon)
            if e:
                canon = _EXPERT.sub(f".mlp.experts.local_experts.{experts_of[local][int(e.group(1))]}.", canon)
        out[name] = canon
    return out


def canonical_init(name: str, shape: torch.Size, seed: int, num_layers: int) -> torch.Tensor:
    """Deterministic initial value of canonical parameter `name` (Megatron's init rules:
    norms at 1, output projections scaled by 1/sqrt(2 L), others N(0, 0.02))."""
    if re.search(r"(norm|layernorm)\.weight$", name):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = 0.02 / (2.0 * num_layers) ** 0.5
    return torch.randn(shape, generator=g) * std


@torch.no_grad()
def init_layout_invariant(model: torch.nn.Module, seed: int, num_layers: int, names: dict[str, str] | None = None) -> None:
    names = names or canonical_names(model)
    for name, p in model.named_parameters():
        p.copy_(canonical_init(names[name], p.shape, seed, num_layers))
