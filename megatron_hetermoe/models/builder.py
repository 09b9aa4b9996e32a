"""Build the Mixtral-style MoE GPTModel with the kernels the rank can run, and give it weights
that do not depend on the parallel layout or the kernels (so any two layouts start identical).

Kernels (`choose_kernels`, decided once per run from the device, what imports and Megatron's
--transformer-impl / --moe-grouped-gemm):

    name            layer spec (megatron-core)                          experts         attention
    "te"            get_gpt_layer_with_transformer_engine_spec, grouped  TEGroupedMLP    TE (fused)
    "te_sequential" get_gpt_layer_with_transformer_engine_spec           SequentialMLP   TE (fused)
    "grouped"       get_gpt_layer_local_spec, moe_grouped_gemm (legacy)  GroupedMLP      local (unfused)
    "local"         get_gpt_layer_local_spec                             SequentialMLP   local (unfused)

The same weights have other names (and for GroupedMLP another layout) under each: canonical
names (plan/expert_names.py) are one namespace for all of them.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron_hetermoe.config import ModelConfig, ParallelConfig
from megatron_hetermoe.errors import UserError
from megatron_hetermoe.plan import expert_names

PRECISIONS = ("fp32", "bf16", "fp16")

# --- kernels ---------------------------------------------------------------------------------
KERNELS = ("local", "te", "te_sequential", "grouped")
TRANSFORMER_IMPLS = ("local", "transformer_engine")  # Megatron-LM's --transformer-impl values run here


class KernelError(UserError, ValueError):
    """Kernels asked for (--transformer-impl, --moe-grouped-gemm) that cannot run here."""


class KernelChoice(NamedTuple):
    """The kernels a run uses and why (`name, reason = choose_kernels(...)`)."""

    name: str
    reason: str

    @property
    def transformer_impl(self) -> str:
        return "transformer_engine" if self.name in ("te", "te_sequential") else "local"

    @property
    def moe_grouped_gemm(self) -> bool:
        return self.name in ("te", "grouped")

    @property
    def experts(self) -> str:
        return {"te": expert_names.TE_GROUPED, "grouped": expert_names.GROUPED}.get(self.name, expert_names.SEQUENTIAL)

    def line(self) -> str:
        return f"kernels: {self.name} ({self.reason})"


def transformer_engine_status() -> tuple[bool, bool, str]:
    """(transformer-engine imports, it has grouped linear layers for TEGroupedMLP, what was found)."""
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
        from megatron.core.extensions import transformer_engine as mte
    except Exception as e:  # ImportError, or OSError/RuntimeError of a broken install
        return False, False, f"transformer_engine does not import: {type(e).__name__}: {str(e)[:120]}"
    grouped = getattr(mte, "TEColumnParallelGroupedLinear", None) is not None
    return True, grouped, f"transformer-engine {getattr(te, '__version__', '?')}"


def grouped_gemm_status() -> tuple[bool, str]:
    """(megatron-core's legacy GroupedMLP can run: the grouped_gemm package imports and this
    megatron-core still has GroupedMLP, what was found)."""
    from megatron.core.transformer.moe import experts as mexperts

    if not hasattr(mexperts, "GroupedMLP"):
        return False, "this megatron-core has no legacy GroupedMLP"
    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg
    except Exception as e:
        return False, f"megatron's grouped_gemm_util does not import: {type(e).__name__}: {e}"
    if not gg.grouped_gemm_is_available():
        return False, "the grouped_gemm package does not import"
    return True, "grouped_gemm imports"


def choose_kernels(device, precision: str = "fp32", transformer_impl: str | None = None,
                   moe_grouped_gemm: bool | None = None) -> KernelChoice:
    """The kernels of a rank on `device`. transformer_impl / moe_grouped_gemm: Megatron-LM's
    --transformer-impl and --moe-grouped-gemm with Megatron's meaning when given (an impossible
    request raises KernelError); None: choose automatically, the fastest that runs here:
    TE (with TEGroupedMLP) when transformer-engine imports and the device is CUDA, else the legacy
    GroupedMLP when grouped_gemm imports, the device is CUDA and the run is bf16 (megatron-core's
    GroupedMLP asserts bf16), else megatron-core's local spec (SequentialMLP)."""
    cuda = torch.device(device).type == "cuda"
    if transformer_impl not in (None, *TRANSFORMER_IMPLS):
        raise KernelError(f"--transformer-impl {transformer_impl}: this trainer runs {' or '.join(TRANSFORMER_IMPLS)}")

    def grouped_or_raise(what: str) -> KernelChoice:
        ok, why = grouped_gemm_status()
        if not cuda:
            raise KernelError(f"{what}: GroupedMLP runs on CUDA ranks only, these are CPU ranks; drop --moe-grouped-gemm")
        if not ok:
            raise KernelError(f"{what}: {why} (pip install grouped_gemm, or use transformer-engine); drop "
                              f"--moe-grouped-gemm")
        if precision != "bf16":
            raise KernelError(f"{what}: megatron-core's GroupedMLP runs bf16 only (it asserts config.bf16), this run is "
                              f"{precision}; add --bf16 or drop --moe-grouped-gemm")
        return KernelChoice("grouped", f"{what}: local spec, GroupedMLP experts; {why}")

    if transformer_impl == "transformer_engine":
        te, te_grouped, why = transformer_engine_status()
        if not te:
            raise KernelError(f"--transformer-impl transformer_engine: {why}; install transformer-engine, or use "
                              f"--transformer-impl local (or leave the flag out to choose automatically)")
        if not cuda:
            raise KernelError("--transformer-impl transformer_engine: transformer-engine runs on CUDA ranks only, these "
                              "are CPU ranks; use --transformer-impl local")
        if moe_grouped_gemm:
            if not te_grouped:
                raise KernelError(f"--transformer-impl transformer_engine --moe-grouped-gemm: {why} has no grouped "
                                  f"linear layers (TEGroupedMLP needs transformer-engine >= 1.7)")
            return KernelChoice("te", f"--transformer-impl transformer_engine --moe-grouped-gemm: TEGroupedMLP experts; {why}")
        return KernelChoice("te_sequential", f"--transformer-impl transformer_engine: TE spec, SequentialMLP experts "
                                             f"(no --moe-grouped-gemm); {why}")
    if transformer_impl == "local":
        if moe_grouped_gemm:
            return grouped_or_raise("--transformer-impl local --moe-grouped-gemm")
        return KernelChoice("local", "--transformer-impl local: megatron-core's local spec, SequentialMLP experts")
    # automatic
    if not cuda:
        if moe_grouped_gemm:
            grouped_or_raise("--moe-grouped-gemm")  # raises: CPU
        return KernelChoice("local", "automatic: CPU ranks run megatron-core's local spec, SequentialMLP experts")
    te, te_grouped, te_why = transformer_engine_status()
    if te:
        if te_grouped:
            return KernelChoice("te", f"automatic: {te_why} imports on CUDA: TE spec, TEGroupedMLP experts")
        if not moe_grouped_gemm:
            return KernelChoice("te_sequential", f"automatic: {te_why} imports on CUDA but has no grouped linear "
                                                 f"layers: TE spec, SequentialMLP experts")
    if moe_grouped_gemm:
        return grouped_or_raise(f"--moe-grouped-gemm ({te_why})")
    gg, gg_why = grouped_gemm_status()
    if gg and precision == "bf16":
        return KernelChoice("grouped", f"automatic: no transformer-engine ({te_why}); {gg_why}, bf16 on CUDA: "
                                       f"local spec, GroupedMLP experts")
    why = gg_why if not gg else f"{gg_why} but GroupedMLP runs bf16 only, this run is {precision}"
    return KernelChoice("local", f"automatic: no transformer-engine ({te_why}); {why}: megatron-core's local "
                                 f"spec, SequentialMLP experts")


def config_kernels(config) -> str:
    """The kernels a TransformerConfig made by transformer_config() was made for."""
    te = getattr(config, "transformer_impl", "local") == "transformer_engine"
    grouped = bool(getattr(config, "moe_grouped_gemm", False))
    return ("te" if grouped else "te_sequential") if te else ("grouped" if grouped else "local")


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter and activation dtype of a precision name (TrainConfig.precision)."""
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r} is unknown; use one of {list(PRECISIONS)}") from None


def transformer_config(model: ModelConfig, par: ParallelConfig, precision: str = "fp32", kernels: str = "local",
                       **overrides):
    """megatron-core's TransformerConfig of `model`; `precision` sets bf16/fp16 and
    params_dtype as Megatron-LM's --bf16/--fp16 do; `kernels` (KERNELS, choose_kernels) sets
    transformer_impl and moe_grouped_gemm as Megatron-LM's flags do."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} is unknown; use one of {list(KERNELS)}")
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
        sequence_parallel=par.sequence_parallel,
        expert_tensor_parallel_size=1,  # experts are never tensor-parallel here (tp_shards.py)
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
        transformer_impl="transformer_engine" if kernels in ("te", "te_sequential") else "local",
        moe_grouped_gemm=kernels in ("te", "grouped"),
    )
    if kernels in ("te", "te_sequential") and overrides.get("deterministic_mode"):
        # megatron-core refuses TE's attention in deterministic mode unless this is 0 (Megatron-LM's advice).
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
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


def layer_spec(model: ModelConfig, kernels: str = "local"):
    """megatron-core's GPT layer spec for `kernels` (the table in this module's docstring)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_hetermoe.compat import (
        bind_missing_te_general_gemm,
        moe_experts_spec,
        normalize_layer_spec,
    )

    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} is unknown; use one of {list(KERNELS)}")
    bind_missing_te_general_gemm()  # the router needs it without transformer-engine (compat.py)
    if kernels == "local":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm")
    elif kernels == "grouped":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm",
                                                        moe_grouped_gemm=True)
    else:  # TE's norms read config.normalization (RMSNorm)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=model.num_experts,
                                                                          moe_grouped_gemm=kernels == "te")
    # 0.18+ give the MoE mlp as builders; normalized to 0.16.1's ModuleSpec form (compat.py).
    spec = normalize_layer_spec(spec)
    want = {"te": expert_names.TE_GROUPED, "grouped": expert_names.GROUPED}.get(kernels, expert_names.SEQUENTIAL)
    experts = moe_experts_spec(spec)
    got = getattr(getattr(experts, "module", experts), "__name__", repr(experts))
    if got != want:  # e.g. a megatron-core whose local spec dropped the legacy GroupedMLP
        raise RuntimeError(f"kernels {kernels!r}: megatron-core's spec gives {got} experts, not {want}")
    return spec


def gpt_kwargs(model: ModelConfig) -> dict:
    """GPTModel's arguments beyond config, spec and groups for `model` (a Mixtral-style model:
    untied embeddings, RoPE)."""
    return {"vocab_size": model.vocab_size, "max_sequence_length": model.seq_length,
            "share_embeddings_and_output_weights": False, "position_embedding_type": "rope"}


def build_gpt(model: ModelConfig, config, spec=None, pre_process: bool = True, post_process: bool = True,
              pg_collection=None, pp_rank: int | None = None):
    """One pipeline stage of the GPT model (all of it when PP=1); without `spec`, the layer spec
    of the kernels `config` was made for (transformer_config's `kernels`)."""
    from megatron.core.models.gpt import GPTModel

    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    return GPTModel(
        config=config,
        transformer_layer_spec=spec if spec is not None else layer_spec(model, config_kernels(config)),
        pre_process=pre_process, post_process=post_process, **gpt_kwargs(model), **kw,
    )


def wrap_precision(config, module: torch.nn.Module) -> torch.nn.Module:
    """Megatron-LM's get_model: a bf16/fp16 model chunk is wrapped in Float16Module (which
    casts it) before DDP; fp32 chunks are returned as they are."""
    if not (config.bf16 or config.fp16):
        return module
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, module)


def unwrap(model) -> torch.nn.Module:
    """The module inside DDP and Float16Module (a model chunk list: its first chunk)."""
    m = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(m, "module"):
        m = m.module
    return m


def wrapped_names(model: torch.nn.Module, names: dict[str, str]) -> dict[str, str]:
    """`names` (the unwrapped module's local name -> canonical name) keyed by the names the
    wrapped model (DDP, Float16Module) gives the same parameters."""
    by_param = {p: names[n] for n, p in unwrap(model).named_parameters()}
    return {n: by_param[p] for n, p in model.named_parameters()}


# --- canonical names: the same parameter has the same name in every layout -----------------
_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^(?:module\.)*mtp\.layers\.(\d+)\.transformer_layer\.")


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """local parameter name -> canonical name: the name in a plain Megatron model with PP=1, EP=1
    and the local spec (global layer and expert indices, no DDP wrapper, SequentialMLP's names).

    Layer numbers come from TransformerLayer.layer_number (global, 1-based) and expert ids
    from MoELayer.local_expert_indices, so PP and EP shards map onto one namespace; expert and
    fused-norm names of other kernels map through plan/expert_names.py (a GroupedMLP weight,
    which holds several experts, gets its label `...mlp.experts.weight1[E0,E1]`).
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer_of: dict[int, int] = {}
    experts_of: dict[int, list[int]] = {}
    mtp_experts: dict[int, list[int]] = {}  # MTP layer k's transformer layer (names keep k: PP=1)
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        m = re.match(r"^(?:module\.)*decoder\.layers\.(\d+)$", name)
        if m and isinstance(mod, TransformerLayer):
            layer_of[int(m.group(1))] = mod.layer_number - 1
            mlp = mod.mlp
            if hasattr(mlp, "local_expert_indices"):
                experts_of[int(m.group(1))] = list(mlp.local_expert_indices)
        m = _MTP_LAYER.match(name + ".")  # the TransformerLayer inside MTP layer k
        if m and isinstance(mod, TransformerLayer) and hasattr(mod.mlp, "local_expert_indices"):
            mtp_experts[int(m.group(1))] = list(mod.mlp.local_expert_indices)
    out = {}
    for name, _ in model.named_parameters():
        canon = re.sub(r"^(?:module\.)*", "", name)
        m = _LAYER.match(name)
        if m:
            local = int(m.group(1))
            canon = _LAYER.sub(f"decoder.layers.{layer_of[local]}.", name)
            canon = expert_names.canonical_name(canon, lambda pre, local=local: experts_of[local])
        m = _MTP_LAYER.match(name)
        if m and int(m.group(1)) in mtp_experts:
            canon = expert_names.canonical_name(canon, lambda pre, k=int(m.group(1)): mtp_experts[k])
        out[name] = canon
    return out


def _init_kind(name: str) -> str:
    """Which of Megatron's init rules a canonical parameter follows: "norm" (weights of norms),
    "bias", "embedding" (word and position embeddings: embedding_init_method), "output" (attention
    and MLP/expert output projections: output_layer_init_method) or "weight" (init_method:
    QKV, fc1, routers and their bias, the output layer)."""
    if re.search(r"(norm|layernorm)\.weight$", name):
        return "norm"
    if name.endswith("router.bias"):  # Megatron's TopKRouter draws its bias by init_method, unlike linear layers
        return "weight"
    if name.endswith("bias"):
        return "bias"
    if name.startswith("embedding."):
        return "embedding"
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return "output"
    return "weight"


def canonical_init(name: str, shape: torch.Size, seed: int, config) -> torch.Tensor:
    """Deterministic initial value of canonical parameter `name`, by Megatron's init method for
    its kind in `config` (a TransformerConfig, built from Megatron's flags: --init-method-std,
    --init-method-xavier-uniform, --embedding-init-method-std, --apply-layernorm-1p): norms at 1
    (0 with zero-centered gamma, whose forward adds 1), biases at 0, embeddings by
    embedding_init_method, output projections by output_layer_init_method (N(0, std/sqrt(2 L)) by
    default), others by init_method. The random draw is seeded by (seed, name) alone, so every
    layout and kernel gets the same values."""
    kind = _init_kind(name)
    if kind == "norm":
        return torch.zeros(shape) if config.layernorm_zero_centered_gamma else torch.ones(shape)
    if kind == "bias":
        return torch.zeros(shape)
    method = {"embedding": config.embedding_init_method, "output": config.output_layer_init_method,
              "weight": config.init_method}[kind]
    key = seed * 1_000_003 + zlib.crc32(name.encode())
    normal = _normal_params(method)
    if normal is not None:  # Megatron's normal init: drawn as before for bitwise-stable starts
        mean, std = normal
        return torch.randn(shape, generator=torch.Generator().manual_seed(key)) * std + mean
    out = torch.empty(shape)
    with torch.random.fork_rng(devices=[]):  # any other init method Megatron's config holds
        torch.manual_seed(key)
        method(out)
    return out


def _normal_params(method) -> tuple[float, float] | None:
    """(mean, std) of an init method that is torch.nn.init.normal_ with fixed arguments
    (megatron.core.utils.init_method_normal / scaled_init_method_normal), else None."""
    import functools

    if isinstance(method, functools.partial) and method.func is torch.nn.init.normal_ and not method.args:
        return float(method.keywords.get("mean", 0.0)), float(method.keywords.get("std", 1.0))
    return None


@torch.no_grad()
def init_layout_invariant(model: torch.nn.Module, seed: int, config, names: dict[str, str] | None = None,
                          tp_group=None) -> None:
    """Every parameter at canonical_init of its canonical name under `config`'s init methods: the
    same values under any layout and any kernels (a GroupedMLP weight is packed from its experts'
    canonical values). With `tp_group` of size > 1, a TP-split parameter gets this rank's shard
    of the canonical FULL tensor (models/tp_shards.py), so TP=1 and TP=2 start identical."""
    from megatron_hetermoe.models import tp_shards

    names = names or canonical_names(model)
    specs = tp_shards.module_specs(model, tp_group, glu=bool(getattr(config, "gated_linear_unit", False)))
    for name, p in model.named_parameters():
        c = names[name]
        if expert_names.is_label(c):
            p.copy_(expert_names.pack(c, {k: canonical_init(k, torch.Size(s), seed, config)
                                          for k, s in expert_names.canonical_shapes(c, p.shape).items()}))
        else:
            spec = specs[name]
            p.copy_(tp_shards.shard(canonical_init(c, tp_shards.full_shape(p.shape, spec), seed, config), spec))
