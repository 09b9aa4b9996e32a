"""Every configuration dataclass of a run, in one module that imports no torch and no
megatron: the model shape (YAML-backed), Megatron's parallel sizes, data and tokenizer flags,
the training run, zebra's runtime options and the HeterMoE run (plan schedule, recompute,
timeline). Flags are parsed into these (training/args.py); everything downstream reads them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.limits import MODEL_LIMITS
from megatron_hetermoe.paths import read_yaml_mapping, resolve_config
from megatron_hetermoe.vocabulary import CpComm
from megatron_hetermoe import layer_pattern as moe_layers  # layer 0: no torch, no megatron
from megatron_hetermoe.vocabulary import Role

MEGATRON_ROLE = Role.MEGATRON  # a rank of plain Megatron EP (the reference)

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")



class ModelConfigError(UserError, ValueError):
    """A model config that cannot be built; the message names the field, the value and the fix."""


class MlpActivation(str, Enum):
    """An MLP's activation as Megatron-LM's flags give it: --swiglu (gated SiLU), --quick-geglu
    (gated quick-GeLU), --squared-relu, or neither (GeLU). Gated ones have fc1 of 2 x ffn (gate
    and up), so the same GEMMs as SwiGLU; the others fc1 of ffn."""
    SWIGLU = "swiglu"
    QUICK_GEGLU = "quick-geglu"
    GELU = "gelu"
    SQUARED_RELU = "squared-relu"

    @property
    def gated(self) -> bool:
        return self in (MlpActivation.SWIGLU, MlpActivation.QUICK_GEGLU)


class Normalization(str, Enum):
    """Megatron's --normalization (its default is LayerNorm, with a bias; the plugin builds RMSNorm)."""
    RMSNORM = "RMSNorm"
    LAYERNORM = "LayerNorm"


class SoftmaxType(str, Enum):
    """Megatron's --softmax-type: attention sinks. 'learnable' holds one offset per head."""
    VANILLA = "vanilla"
    OFF_BY_ONE = "off-by-one"
    LEARNABLE = "learnable"


class LoadBalancing(str, Enum):
    """Megatron's --moe-router-load-balancing-type this plugin trains: the GShard/Switch
    load-balancing loss per microbatch (aux_loss), DeepSeek-V2's per sequence (seq_aux_loss), or
    none (aux-loss-free balancing: none with moe_router_enable_expert_bias). Megatron's
    global_aux_loss and sinkhorn are refused (REFUSED_LOAD_BALANCING)."""
    AUX_LOSS = "aux_loss"
    SEQ_AUX_LOSS = "seq_aux_loss"
    NONE = "none"


# Megatron's other load-balancing types, and why they are refused.
REFUSED_LOAD_BALANCING = {
    "global_aux_loss": "its tokens-per-expert tracker is reduced over Megatron's data-parallel groups, which "
                       "HeterMoE's attention ranks do not form",
    "sinkhorn": "Sinkhorn routing is not built here",
}


class RouterScore(str, Enum):
    """Megatron's --moe-router-score-function."""
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class PositionEmbedding(str, Enum):
    """Megatron's --position-embedding-type of a GPT model (learned_absolute holds a table of
    max_position_embeddings x hidden; rope and none hold nothing)."""
    ROPE = "rope"
    LEARNED_ABSOLUTE = "learned_absolute"
    NONE = "none"


# ModelConfig fields by kind, each checked on its own: positive ints; positive ints or None;
# booleans; closed vocabularies (a string of the enum is read into it).
_COUNTS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
           "num_experts", "moe_router_topk", "vocab_size", "seq_length", "kv_lora_rank", "qk_head_dim",
           "qk_pos_emb_head_dim", "v_head_dim")
_OPTIONAL_COUNTS = ("moe_shared_expert_intermediate_size", "mtp_num_layers", "kv_channels", "num_query_groups",
                    "q_lora_rank", "max_position_embeddings", "moe_router_num_groups", "moe_router_group_topk")
_FLAGS = ("qk_layernorm", "multi_latent_attention", "add_bias_linear", "add_qkv_bias",
          "untie_embeddings_and_output_weights", "attention_output_gate", "moe_shared_expert_gate",
          "moe_router_enable_expert_bias")
_VOCABULARIES = {"mlp_activation": MlpActivation, "normalization": Normalization, "softmax_type": SoftmaxType,
                 "position_embedding_type": PositionEmbedding, "moe_router_load_balancing_type": LoadBalancing,
                 "moe_router_score_function": RouterScore}
# Widths without a bound of their own in limits.py are bounded by hidden_size's.
_WIDTH_LIMIT = ("kv_channels", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def _memoized(fn):
    """Memoize a ModelConfig method by its arguments, in the instance (frozen: its fields never
    change; dataclasses.replace makes a new instance). The planner asks them millions of times."""
    @functools.wraps(fn)
    def cached(self, *args):
        memo = self.__dict__.setdefault("_memo", {})
        key = (fn.__name__, *args)
        if key not in memo:
            memo[key] = fn(self, *args)
        v = memo[key]
        return list(v) if isinstance(v, list) else v  # a caller's list is its own

    return cached


@dataclass(frozen=True)
class ModelConfig:
    """A MoE GPT as Megatron-core builds it. The defaults are the plugin's own Mixtral-style model
    (SwiGLU MLPs, RMSNorm, RoPE, no bias, untied embeddings, multi-head attention of
    hidden/heads channels); the other fields carry Megatron-LM's flags of the same name with
    Megatron's meaning, so a model any Megatron-LM command line builds can be described and priced:
    `moe_layer_freq` (--moe-layer-freq) makes some layers dense (an MLP of ffn_hidden_size instead
    of experts; default 1: every layer MoE); `moe_shared_expert_intermediate_size` gives every MoE
    layer a shared-expert MLP of that size that all tokens pass through (default None: none);
    `mtp_num_layers` (--mtp-num-layers) adds multi-token prediction layers after the decoder's
    (default None: none). `num_layers` is the decoder's total (Megatron's --num-layers);
    `num_moe_layers` and `dense_layers` split it (the MTP layers are not in them: `planned_*`
    counts them too).

    Attention: `kv_channels` (--kv-channels, None: hidden/heads) per head, `num_query_groups`
    (--num-query-groups with --group-query-attention, None: one per head), `qk_layernorm`,
    `attention_output_gate`, `softmax_type` (attention sinks), `window_size` (--window-size
    (left, right) of sliding-window attention, None: full) on the layers `window_attn_skip_freq`
    leaves windowed (Megatron's rule: an int N, layer number n (from 1) is windowed unless n % N
    == 0; a list, 1 = windowed); or multi-latent attention (`multi_latent_attention`, with
    `q_lora_rank` (None: no query compression), `kv_lora_rank`, `qk_head_dim`,
    `qk_pos_emb_head_dim` (the RoPE part), `v_head_dim`, Megatron's defaults). MLPs:
    `mlp_activation`; `add_bias_linear` / `add_qkv_bias` biases; `normalization`;
    `moe_shared_expert_gate`. Routing: `moe_router_num_groups` / `moe_router_group_topk`
    (group-limited routing: a token's experts lie in group_topk of num_groups groups);
    `moe_router_load_balancing_type` (LoadBalancing), `moe_router_score_function` (RouterScore),
    `moe_router_enable_expert_bias` with `moe_router_bias_update_rate` (aux-loss-free balancing:
    a per-expert bias added to the scores for the top-k choice, moved by the rate towards balance
    after every step; Megatron takes it with sigmoid scores only), Megatron's defaults.
    Embeddings: `untie_embeddings_and_output_weights`, `position_embedding_type`,
    `max_position_embeddings` (None: seq_length; Megatron-LM requires the flag, a YAML may leave it out)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.01
    vocab_size: int = 32000
    seq_length: int = 4096
    # An int N (layer i is MoE when i % N == 0) or one 0/1 per layer (1 = MoE); the string forms
    # Megatron takes ("2", "([0]+[1]*2)") are read into these. Kept as Megatron's int or list,
    # so it can be handed to a TransformerConfig as it is.
    moe_layer_freq: int | list[int] = 1
    moe_shared_expert_intermediate_size: int | None = None
    mtp_num_layers: int | None = None
    # ---- attention (Megatron's flags of these names; defaults: the plugin's model) -----------
    kv_channels: int | None = None
    num_query_groups: int | None = None
    qk_layernorm: bool = False
    attention_output_gate: bool = False
    # Closed vocabularies (SoftmaxType, MlpActivation, Normalization, PositionEmbedding) are kept as
    # their values, plain strings, so a ModelConfig serializes as it did (YAML, JSON, checkpoints);
    # __post_init__ checks each against its enum.
    softmax_type: str = SoftmaxType.VANILLA.value
    window_size: list[int] | None = None  # [left, right]: a list, so it serializes as YAML
    window_attn_skip_freq: int | list[int] | None = None
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # ---- MLPs, norms, biases, routing, embeddings ---------------------------------------------
    mlp_activation: str = MlpActivation.SWIGLU.value
    normalization: str = Normalization.RMSNORM.value
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    moe_shared_expert_gate: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_load_balancing_type: str = LoadBalancing.AUX_LOSS.value
    moe_router_score_function: str = RouterScore.SOFTMAX.value
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    untie_embeddings_and_output_weights: bool = True
    position_embedding_type: str = PositionEmbedding.ROPE.value
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ModelConfigError(f"model name={self.name!r} must be a non-empty string")
        for f in _COUNTS + _OPTIONAL_COUNTS:
            v = getattr(self, f)
            if f in _OPTIONAL_COUNTS and v is None:
                continue
            # bool is an int subclass: `num_layers: true` in YAML must not mean 1.
            if type(v) is not int or v <= 0:
                what = " (or absent: none)" if f in _OPTIONAL_COUNTS else ""
                raise ModelConfigError(f"model {self.name!r}: {f}={v!r} must be a positive integer{what}")
            limit = MODEL_LIMITS.get("hidden_size" if f in _WIDTH_LIMIT else f)
            if limit is not None and v > limit:  # limits.py: no cluster holds more
                raise ModelConfigError(f"model {self.name!r}: {f}={v} is above {limit}, the "
                                       f"largest this plugin takes (megatron_hetermoe/limits.py); check the value")
        for f in _FLAGS:
            if type(getattr(self, f)) is not bool:
                raise ModelConfigError(f"model {self.name!r}: {f}={getattr(self, f)!r} must be true or false")
        lb = self.moe_router_load_balancing_type
        if isinstance(lb, str) and lb in REFUSED_LOAD_BALANCING:
            raise ModelConfigError(f"model {self.name!r}: moe_router_load_balancing_type={lb!r} is not supported "
                                   f"({REFUSED_LOAD_BALANCING[lb]}); use one of {[x.value for x in LoadBalancing]}")
        for f, vocab in _VOCABULARIES.items():
            v = getattr(self, f)
            try:
                object.__setattr__(self, f, vocab(v).value)
            except ValueError:
                raise ModelConfigError(f"model {self.name!r}: {f}={v!r} is not one of "
                                       f"{[x.value for x in vocab]}") from None
        c = self.moe_aux_loss_coeff
        if type(c) not in (int, float) or not math.isfinite(c) or c < 0:
            raise ModelConfigError(f"model {self.name!r}: moe_aux_loss_coeff={c!r} must be a finite number >= 0 "
                                   f"(Megatron's default is 0.01; 0 disables the load-balancing loss)")
        self._check_router_balancing()
        self._check_moe_layer_freq()
        self._check_attention()
        self._check_window()
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ModelConfigError(
                f"model {self.name!r}: moe_router_topk={self.moe_router_topk} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        self._check_router_groups()
        if self.moe_shared_expert_intermediate_size and self.add_bias_linear:
            raise ModelConfigError(f"model {self.name!r}: shared experts with add_bias_linear: megatron-core's "
                                   f"SharedExpertMLP refuses biases; drop one (--disable-bias-linear)")

    def _check_attention(self) -> None:
        """The head shapes Megatron's modules take (attention.py, multi_latent_attention.py)."""
        heads = self.num_attention_heads
        if self.multi_latent_attention:
            if self.num_query_groups is not None:
                raise ModelConfigError(f"model {self.name!r}: num_query_groups={self.num_query_groups} with "
                                       f"multi_latent_attention: Megatron refuses group-query attention with MLA; "
                                       f"drop one")
            if self.qk_pos_emb_head_dim % 2:
                raise ModelConfigError(f"model {self.name!r}: qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} is odd; "
                                       f"RoPE needs an even head dim")
            return
        if self.kv_channels is None and self.hidden_size % heads:
            raise ModelConfigError(
                f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={heads}; pick a head count that divides it, or give kv_channels "
                f"(Megatron's --kv-channels)"
            )
        if self.head_dim % 2 and self.position_embedding_type == PositionEmbedding.ROPE:
            # RoPE rotates pairs of channels; an odd head dim fails inside the first forward.
            given = (f"kv_channels={self.kv_channels}" if self.kv_channels is not None else
                     f"hidden_size/num_attention_heads = {self.hidden_size}/{heads} = {self.head_dim}")
            raise ModelConfigError(f"model {self.name!r}: head dim {given} is odd; RoPE needs an even head dim")
        g = self.num_query_groups
        if g is not None and heads % g:
            raise ModelConfigError(f"model {self.name!r}: num_query_groups={g} does not divide "
                                   f"num_attention_heads={heads}; Megatron needs heads to be a multiple of the "
                                   f"groups")

    def _check_window(self) -> None:
        w = self.window_size
        if w is not None:
            if (not isinstance(w, (tuple, list)) or len(w) != 2 or any(type(x) is not int or x < -1 for x in w)):
                raise ModelConfigError(f"model {self.name!r}: window_size={self.window_size!r} must be two integers "
                                       f"(left, right), -1 meaning unbounded (Megatron's --window-size, e.g. 128,0)")
            object.__setattr__(self, "window_size", list(w))  # a fresh list: never the caller's
        f = self.window_attn_skip_freq
        if f is None:
            return
        n = self.num_layers + (self.mtp_num_layers or 0)
        if isinstance(f, str):
            try:
                f = moe_layers.parse_moe_layer_freq(f)  # Megatron reads both flags with moe_freq_type
            except moe_layers.LayerPatternError as e:
                raise ModelConfigError(f"model {self.name!r}: window_attn_skip_freq={f!r}: {e}") from None
            object.__setattr__(self, "window_attn_skip_freq", f)
        if not ((type(f) is int and f >= 1) or (isinstance(f, list) and all(x in (0, 1) and type(x) is int for x in f)
                                                and len(f) >= self.num_layers)):
            raise ModelConfigError(f"model {self.name!r}: window_attn_skip_freq={f!r} must be an int N >= 1 (every "
                                   f"N-th layer full attention) or a list of 0/1 per layer ({self.num_layers} decoder "
                                   f"layers{f', {n} with the MTP layers' if n > self.num_layers else ''}; 1 = "
                                   f"windowed)")

    def _check_router_balancing(self) -> None:
        r = self.moe_router_bias_update_rate
        if type(r) not in (int, float) or not math.isfinite(r) or r < 0:
            raise ModelConfigError(f"model {self.name!r}: moe_router_bias_update_rate={r!r} must be a finite number "
                                   f">= 0 (Megatron's default is 1e-3)")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != RouterScore.SIGMOID:
            raise ModelConfigError(f"model {self.name!r}: moe_router_enable_expert_bias with "
                                   f"moe_router_score_function={self.moe_router_score_function!r}: Megatron takes the "
                                   f"expert bias with sigmoid scores only; set moe_router_score_function: sigmoid "
                                   f"(--moe-router-score-function sigmoid)")

    def _check_router_groups(self) -> None:
        n, k = self.moe_router_num_groups, self.moe_router_group_topk
        if n is None and k is None:
            return
        if n is None or k is None or self.num_experts % n or not 1 <= k <= n:
            raise ModelConfigError(f"model {self.name!r}: moe_router_num_groups={n}, moe_router_group_topk={k}: give "
                                   f"both (group-limited routing), the groups dividing num_experts={self.num_experts} "
                                   f"and group_topk in 1..num_groups")
        if self.moe_router_topk > k * (self.num_experts // n):
            raise ModelConfigError(f"model {self.name!r}: moe_router_topk={self.moe_router_topk} experts do not fit in "
                                   f"moe_router_group_topk={k} groups of {self.num_experts // n}; raise the group "
                                   f"count")

    def _check_moe_layer_freq(self) -> None:
        """Read moe_layer_freq as Megatron does (an int, or its list; a string form is read into
        one) and check it leaves at least one MoE layer in num_layers."""
        v = self.moe_layer_freq
        shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:60] + "..."
        n = self.num_layers
        fix = (f"use an int N >= 1 (layer i is MoE when i % N == 0; 1: every layer) or a list of num_layers={n} "
               f"entries, 0 = dense and 1 = MoE"
               + (f", e.g. '([0]+[1]*{n - 1})' for a dense first layer" if n > 1 else ""))
        if type(v) not in (int, str, list) or (isinstance(v, list) and any(type(x) is not int for x in v)):
            raise ModelConfigError(f"model {self.name!r}: moe_layer_freq={shown} is not an int, a list of 0/1 nor a "
                                   f"list expression; {fix}")
        try:
            freq = moe_layers.parse_moe_layer_freq(v)
            moe_layers.dense_layers(freq, self.num_layers)
        except (moe_layers.LayerPatternError, ValueError) as e:  # ValueError: an int string too long to read
            raise ModelConfigError(f"model {self.name!r}: moe_layer_freq={shown} is not a valid layer pattern ({e}); "
                                   f"{fix}") from None
        object.__setattr__(self, "moe_layer_freq", freq)  # a fresh int or list: never the caller's list

    def __hash__(self) -> int:  # frozen, but moe_layer_freq may be a list (Megatron's type)
        return hash(tuple(tuple(v) if isinstance(v, list) else v
                          for v in (getattr(self, f.name) for f in fields(self))))

    @classmethod
    def load(cls, path_or_name: str | Path) -> "ModelConfig":
        path = resolve_config(str(path_or_name), "models")
        raw = read_yaml_mapping(path, "model config", ModelConfigError)
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ModelConfigError(f"{path}: unknown model field(s) {sorted(map(str, unknown))}; "
                                   f"known: {sorted(names)}")
        missing = {f.name for f in fields(cls) if f.default is dataclasses.MISSING} - set(raw)
        if missing:
            raise ModelConfigError(f"{path}: missing model field(s) {sorted(missing)}")
        try:
            return cls(**raw)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- attention shape (Megatron's modules: attention.py, multi_latent_attention.py) ---------
    @property
    def head_dim(self) -> int:
        """Channels per head of (non-MLA) attention: --kv-channels, Megatron's default hidden/heads."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def activation(self) -> MlpActivation:
        return MlpActivation(self.mlp_activation)

    @property
    def query_groups(self) -> int:
        """K/V heads: --num-query-groups (with --group-query-attention), else one per head (MHA)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def qk_channels(self) -> int:
        """Channels of a query and a key head in the attention core (MLA: qk_head_dim + its RoPE part)."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def v_channels(self) -> int:
        """Channels of a value head (and of the output projection's input per head)."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @_memoized
    def attention_linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every linear layer of one layer's attention, as megatron-core builds them."""
        h, a = self.hidden_size, self.num_attention_heads
        if self.multi_latent_attention:
            q = a * self.qk_channels
            out = ([(h, q)] if self.q_lora_rank is None else [(h, self.q_lora_rank), (self.q_lora_rank, q)])
            return out + [(h, self.kv_lora_rank + self.qk_pos_emb_head_dim),
                          (self.kv_lora_rank, a * (self.qk_head_dim + self.v_head_dim)), (a * self.v_head_dim, h)]
        d, g = self.head_dim, self.query_groups
        qkv = a * d + 2 * g * d + (a * d if self.attention_output_gate else 0)
        return [(h, qkv), (a * d, h)]

    @_memoized
    def attention_linear_weights(self) -> int:
        """Weights of one layer's attention GEMMs (multiply-accumulates per token: the same number)."""
        return sum(i * o for i, o in self.attention_linear_shapes())

    def norm_params(self, width: int) -> int:
        """One norm of `width` channels: RMSNorm a weight, LayerNorm a weight and a bias."""
        return width * (2 if self.normalization == Normalization.LAYERNORM else 1)

    @_memoized
    def attention_params(self) -> int:
        """One layer's self-attention module: its GEMMs' weights, their biases (megatron-core: QKV
        with add_bias_linear or add_qkv_bias, the output projection with add_bias_linear; MLA's
        projections have none but its output), the q/k (MLA: q and kv latent) norms with
        qk_layernorm, and the learnable softmax offsets (one per head)."""
        h, a = self.hidden_size, self.num_attention_heads
        n = self.attention_linear_weights()
        if self.multi_latent_attention:
            n += h if self.add_bias_linear else 0
            if self.qk_layernorm:
                n += (self.norm_params(self.kv_lora_rank)
                      + (self.norm_params(self.q_lora_rank) if self.q_lora_rank else 0))
        else:
            qkv_out = self.attention_linear_shapes()[0][1]
            n += (qkv_out if self.add_bias_linear or self.add_qkv_bias else 0) + (h if self.add_bias_linear else 0)
            n += 2 * self.norm_params(self.head_dim) if self.qk_layernorm else 0
        return n + (a if self.softmax_type == SoftmaxType.LEARNABLE else 0)

    @_memoized
    def window_fraction(self, seq_len: int) -> float:
        """Attention-core work of the model's attention layers (decoder and MTP), averaged over
        them, as a fraction of full causal attention at `seq_len`: a windowed layer's query at
        position i attends min(i, left) + 1 keys (Megatron's --window-size (left, right), causal,
        so right adds none), a full one i + 1 (Megatron's is_layer_window_attention picks the
        windowed layers). 1.0 without --window-size."""
        if self.window_size is None or self.window_size[0] < 0 or self.window_size[0] + 1 >= seq_len:
            return 1.0
        w, s = self.window_size[0], seq_len
        windowed = ((w + 1) * (w + 2) // 2 + (s - w - 1) * (w + 1)) / (s * (s + 1) / 2)
        n = self.num_layers + (self.mtp_num_layers or 0)
        f = self.window_attn_skip_freq
        if f is None:
            k = n
        elif isinstance(f, int):
            k = sum(1 for number in range(1, n + 1) if number % f)
        else:
            k = sum(f[:n])
        return (k * windowed + (n - k)) / n

    # ---- layers: MoE and dense (Megatron's --moe-layer-freq) ------------------------------
    @property
    @_memoized
    def moe_layer_pattern(self) -> list[int]:
        """One entry per decoder layer: 1 = MoE layer, 0 = dense layer."""
        return moe_layers.moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    @property
    def dense_layers(self) -> list[int]:
        """Model indices of the decoder layers without experts."""
        return [i for i, v in enumerate(self.moe_layer_pattern) if not v]

    @property
    def moe_layer_ids(self) -> list[int]:
        """Model indices of the decoder's MoE layers."""
        return [i for i, v in enumerate(self.moe_layer_pattern) if v]

    @property
    def num_moe_layers(self) -> int:
        """The decoder's MoE layers (without the MTP layers: planned_num_moe_layers counts them)."""
        return sum(self.moe_layer_pattern)

    @property
    @_memoized
    def planned_dense_layers(self) -> list[int]:
        """A plan's dense_layers: the decoder's, and the MTP layers (model layers num_layers + k)
        when the decoder's last layer is dense (Megatron builds MTP layers from its spec)."""
        return moe_layers.model_dense_layers(self.moe_layer_freq, self.num_layers, self.mtp_num_layers)

    @property
    @_memoized
    def planned_moe_layer_ids(self) -> list[int]:
        """Model indices of the MoE layers, MTP layers included: MoE layer k of a plan (its
        placement, the task lists' layer k) is model layer planned_moe_layer_ids[k]."""
        dense = set(self.planned_dense_layers)
        return [i for i in range(self.num_layers + (self.mtp_num_layers or 0)) if i not in dense]

    @property
    def planned_num_moe_layers(self) -> int:
        """A plan's num_layers: one expert placement per MoE layer, MTP layers included."""
        return len(self.planned_moe_layer_ids)

    @property
    def beyond_every_layer_moe(self) -> list[str]:
        """What of this model the plugin's own trainer does not build (empty: it builds this model).
        That trainer (models/builder.py) builds every layer as an MoE layer without shared experts
        nor MTP, with multi-head attention of hidden/heads channels, SwiGLU, RMSNorm, RoPE, no
        biases, untied embeddings, full softmax attention and ungrouped routing: every other
        value of a field here is named (training/validation.check_plugin_model refuses it; such a
        model trains in Megatron-LM's pretrain_gpt.py)."""
        out = []
        if self.dense_layers:
            out.append(f"dense layers {self.dense_layers} (moe_layer_freq {self.moe_layer_freq!r})")
        if self.moe_shared_expert_intermediate_size:
            out.append(f"shared experts (moe_shared_expert_intermediate_size "
                       f"{self.moe_shared_expert_intermediate_size})")
        if self.mtp_num_layers:
            out.append(f"multi-token prediction layers (mtp_num_layers {self.mtp_num_layers})")
        mha = self.hidden_size // self.num_attention_heads
        if self.kv_channels is not None and (self.hidden_size % self.num_attention_heads or self.kv_channels != mha):
            out.append(f"kv_channels {self.kv_channels} (not hidden/heads)")
        for f, plugin in (("num_query_groups", (None, self.num_attention_heads)), ("qk_layernorm", (False,)),
                          ("attention_output_gate", (False,)), ("multi_latent_attention", (False,)),
                          ("softmax_type", (SoftmaxType.VANILLA,)), ("window_size", (None,)),
                          ("mlp_activation", (MlpActivation.SWIGLU,)), ("normalization", (Normalization.RMSNORM,)),
                          ("add_bias_linear", (False,)), ("add_qkv_bias", (False,)),
                          ("moe_shared_expert_gate", (False,)),
                          ("moe_router_num_groups", (None,)), ("untie_embeddings_and_output_weights", (True,)),
                          ("position_embedding_type", (PositionEmbedding.ROPE,))):
            v = getattr(self, f)
            if v not in plugin:
                out.append(f"{f} {v!r}")
        return out

    # ---- parameters (what megatron-core builds; tests/planner/test_model_params.py) -----------
    @_memoized
    def mlp_params(self, ffn: int) -> int:
        """One MLP of intermediate size `ffn` (an expert, a dense layer's, a shared expert): fc1
        h -> 2 ffn when gated (gate and up), else h -> ffn; fc2 ffn -> h; their biases with
        add_bias_linear. 0 for ffn 0."""
        if not ffn:
            return 0
        h = self.hidden_size
        up = 2 * ffn if self.activation.gated else ffn
        return h * up + ffn * h + ((up + h) if self.add_bias_linear else 0)

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return self.mlp_params(self.moe_ffn_hidden_size)

    def dense_mlp_params(self) -> int:
        """The MLP of one dense layer (ffn_hidden_size)."""
        return self.mlp_params(self.ffn_hidden_size)

    def shared_expert_params(self) -> int:
        """The shared-expert MLP of one MoE layer and its gate (0 without shared experts)."""
        if not self.moe_shared_expert_intermediate_size:
            return 0
        gate = self.hidden_size if self.moe_shared_expert_gate else 0
        return self.mlp_params(self.moe_shared_expert_intermediate_size) + gate

    def router_params(self) -> int:
        """One MoE layer's router: E x h, and E biases with add_bias_linear."""
        return self.num_experts * self.hidden_size + (self.num_experts if self.add_bias_linear else 0)

    @_memoized
    def layer_attention_params(self) -> int:
        """Attention of any layer and the layer's two norms (input and pre-MLP)."""
        return self.attention_params() + 2 * self.norm_params(self.hidden_size)

    @_memoized
    def moe_layer_non_expert_params(self) -> int:
        """What an MoE layer holds besides its routed experts: attention, norms, router, shared expert."""
        return self.layer_attention_params() + self.router_params() + self.shared_expert_params()

    @_memoized
    def dense_layer_params(self) -> int:
        return self.layer_attention_params() + self.dense_mlp_params()

    def mtp_extra_params(self) -> int:
        """One MTP layer besides its transformer layer (multi_token_prediction.py): the embedding
        and hidden norms, the 2h -> h projection, its final norm."""
        h = self.hidden_size
        return 3 * self.norm_params(h) + 2 * h * h

    def embedding_params(self) -> int:
        """The word embedding, and the position table with learned absolute positions."""
        pos = (self.max_position_embeddings or self.seq_length
               if self.position_embedding_type == PositionEmbedding.LEARNED_ABSOLUTE else 0)
        return (self.vocab_size + pos) * self.hidden_size

    def output_params(self) -> int:
        """The output layer's own weight (0 when tied to the embedding)."""
        return self.vocab_size * self.hidden_size if self.untie_embeddings_and_output_weights else 0

    @_memoized
    def non_expert_params(self) -> int:
        """Embedding, output layer, final norm, and every layer but its routed experts (attention,
        norms, routers, shared experts, dense layers' MLPs; the MTP layers and their extras):
        what an attention rank holds."""
        n_dense = len(self.planned_dense_layers)
        layers = self.planned_num_moe_layers * self.moe_layer_non_expert_params() + n_dense * self.dense_layer_params()
        mtp = (self.mtp_num_layers or 0) * self.mtp_extra_params()
        return self.embedding_params() + self.output_params() + layers + mtp + self.norm_params(self.hidden_size)

    def total_params(self) -> int:
        """Every parameter of the model (one pipeline stage, no parallelism): what megatron-core's
        GPTModel of this config holds."""
        return self.non_expert_params() + self.planned_num_moe_layers * self.num_experts * self.expert_params()


CP_COMM_TYPES = (CpComm.P2P, CpComm.ALL_GATHER, CpComm.A2A)  # the --cp-comm-type values the local core runs


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel sizes and dispatcher. `sequence_parallel` is Megatron's
    --sequence-parallel: turned off at TP 1 (as Megatron-LM's validate_args does), required with
    TP > 1 (the model is always MoE: Megatron-LM refuses MoE with TP and no sequence parallelism).
    Experts are never tensor-parallel here (Megatron's --expert-tensor-parallel-size 1). `cp` is
    Megatron's --context-parallel-size: a HeterMoE plan's attention_cp (the Megatron EP trainer runs
    without it). `cp_comm_type` is Megatron's --cp-comm-type: one value for every layer or one per
    layer; p2p (a ring, Megatron's default), all_gather or a2a (models/context_attention.py)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dispatcher: str = "alltoall"  # Megatron's --moe-token-dispatcher-type
    sequence_parallel: bool = False  # Megatron's --sequence-parallel
    cp: int = 1  # Megatron's --context-parallel-size
    cp_comm_type: str | tuple[str, ...] = CpComm.P2P.value  # Megatron's --cp-comm-type

    def __post_init__(self) -> None:
        comms = (self.cp_comm_type,) if isinstance(self.cp_comm_type, str) else tuple(self.cp_comm_type)
        bad = [c for c in comms if c not in CP_COMM_TYPES]
        if bad or not comms:
            raise ValueError(
                f"--cp-comm-type {' '.join(comms)}: runs here are {', '.join(CP_COMM_TYPES)} (a ring, an all-gather "
                f"of keys and values, an all-to-all of heads); transformer-engine's hierarchical a2a+p2p is not built")
        object.__setattr__(self, "cp_comm_type", comms[0] if len(comms) == 1 else comms)
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                f"moe token dispatcher {self.dispatcher!r} is not available on CPU; use alltoall or "
                f"allgather (flex needs DeepEP on GPUs)"
            )
        if type(self.tp) is int and self.tp == 1 and self.sequence_parallel:
            object.__setattr__(self, "sequence_parallel", False)  # Megatron-LM: no SP without TP
        if type(self.tp) is int and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} without --sequence-parallel: When using MoE and tensor "
                f"parallelism, sequence parallelism must be used (Megatron-LM's rule); add --sequence-parallel"
            )


@dataclass(frozen=True)
class DataConfig:
    """Megatron's data and tokenizer flags. No data_path means mock data (--mock-data)."""

    data_path: tuple[str, ...] | None = None  # Megatron --data-path: prefixes, or weight/prefix pairs
    split: str = "969,30,1"  # Megatron's default train,valid,test proportions
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer's size before EOD (Megatron's --vocab-size)
    data_cache_path: str | None = None
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        if self.data_path is not None:
            object.__setattr__(self, "data_path", tuple(self.data_path))
            if not self.data_path:
                raise ValueError("--data-path is empty: give one or more dataset prefixes, or use --mock-data")
            if self.tokenizer_type is None:
                raise ValueError(f"--data-path {' '.join(self.data_path)} needs --tokenizer-type "
                                 f"(one of {', '.join(TOKENIZER_TYPES)}) to know the EOD token and vocab size")


@dataclass(frozen=True)
class LocalCheckpointConfig:
    """Megatron's non-persistent local checkpoints (checkpoint/local.py): every `interval` iterations
    (--non-persistent-save-interval) each rank's state in host memory of its node, under `directory`
    (--non-persistent-local-ckpt-dir, a tmpfs such as /dev/shm), and with --replication of the
    `replication_factor - 1` ranks `replication_jump` apart (--replication-jump, -factor)."""
    directory: str
    interval: int | None  # None: none saved (--non-persistent-save-interval not given); still loaded
    replication_jump: int | None = None  # None: no replication (--replication not given)
    replication_factor: int = 2


@dataclass
class TrainConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_iters: int = 5
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    use_distributed_optimizer: bool = False
    deterministic: bool = False
    emulate: "EmulationSpec | None" = None  # --emulate: time every task as on an emulated cluster
    log_interval: int = 1
    quiet: bool = False
    progress_bar: bool = False  # prefix iteration lines with a bar (the demo)
    tensorboard_dir: str | None = None  # Megatron's --tensorboard-dir: scalars from the first rank
    # The first rank appends each completed step's lm loss here as a JSON line (training/elastic.py
    # keeps the losses of a job whose ranks were lost mid-run); None: nowhere.
    loss_log: str | None = None
    data: DataConfig = field(default_factory=DataConfig)  # no data_path: mock data (data.py)
    # Megatron's --check-for-nan-in-loss-and-grad: "stop" (its default), "skip" or "off" (training/nan_check.py).
    check_for_nan_in_loss_and_grad: str = "stop"
    # Megatron's --save/--load/--save-interval/--ckpt-step (checkpoint/); ckpt_reshard loads a
    # checkpoint of another layout by parameter name (--hetero-ckpt-reshard).
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_step: int | None = None
    ckpt_reshard: bool = False
    # Megatron's --non-persistent-ckpt-type local and its flags; None: no local checkpoints.
    local_ckpt: LocalCheckpointConfig | None = None
    # Megatron's --bf16/--fp16: 16-bit parameters and activations, fp32 main parameters and
    # gradients. Loss scaling as Megatron's: --loss-scale (None: dynamic for fp16, none for
    # bf16), --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis.
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    # Megatron's --transformer-impl (local / transformer_engine) and --moe-grouped-gemm, with its
    # meaning when given; None (not given): the kernels are chosen for the device
    # (models.builder.choose_kernels: TE, else the legacy grouped GEMM, else the local spec).
    transformer_impl: str | None = None
    moe_grouped_gemm: bool | None = None

    @property
    def precision(self) -> str:
        """"bf16", "fp16" or "fp32": the world's parameter and activation precision."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def nan_check_mode(self, pools: "PoolPrecision | None" = None) -> str:
        """check_for_nan_in_loss_and_grad as the trainers apply it: "off" under fp16 with a
        dynamic loss scale (on any pool of `pools`), where a non-finite gradient is the scaler's
        signal (Megatron-LM's validate_args turns the check off there too)."""
        dynamic = pools.dynamic_scale(self.loss_scale) if pools is not None else (self.fp16 and self.loss_scale is None)
        if dynamic:
            return "off"
        return self.check_for_nan_in_loss_and_grad

    def num_microbatches(self, dp: int) -> int:
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by micro batch size "
                f"{self.micro_batch_size} x data-parallel size {dp}; pick a multiple of {per}"
            )
        return self.global_batch_size // per


ISSUERS = ("auto", "single", "threads")


@dataclass(frozen=True)
class EmulationSpec:
    cluster: str  # configs/clusters/NAME.yaml or a path
    model: str  # the emulated model shape (e.g. d1), not the small model that really runs
    seq_len: int
    global_batch: int  # emulated sequences per step
    scale: float = 1.0  # real seconds per emulated second (the initial one with auto_scale)
    activation_checkpointing: bool = True  # the paper's setting; the cost model charges re-forward
    ranks: tuple[int, ...] | None = None  # cluster ranks this job's ranks stand for (None: all, in order)
    # Validity and automatic scale (module docstring).
    auto_scale: bool = False  # pick the scale from a calibration step
    calibrate_step: int = 1  # index (from the run's first step) of the calibration step; earlier steps warm up
    max_overrun: float = 0.03  # a run whose delay bound exceeds this fraction of the step is invalid
    target_overrun: float = 0.01  # what auto_scale aims for (a margin under max_overrun)
    work_margin: float = 1.5  # auto_scale plans for real work this much longer than measured
    max_step_seconds: float = 30.0  # auto_scale never stretches the predicted step beyond this
    calibration_duty: float = 0.25  # auto_scale: the calibration step's real work per rank, at most this of it

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.seq_len <= 0 or self.global_batch <= 0:
            raise ValueError(f"emulation needs scale, seq_len, global_batch > 0; got {self.scale}, "
                             f"{self.seq_len}, {self.global_batch}")
        if not 0 < self.target_overrun <= self.max_overrun or self.calibrate_step < 0 or self.max_step_seconds <= 0:
            raise ValueError(f"emulation needs 0 < target_overrun <= max_overrun, calibrate_step >= 0, "
                             f"max_step_seconds > 0; got {self.target_overrun}, {self.max_overrun}, "
                             f"{self.calibrate_step}, {self.max_step_seconds}")



@dataclass(frozen=True)
class HeteroRunConfig:
    """How a HeterMoE run executes its plan: --hetero-schedule (None: the plan's),
    --recompute-granularity full (zebra recomputes attention stages in backward),
    --timeline-dir (each rank writes its timeline there) and --hetero-zebra-issuer."""
    schedule: str | None = None
    recompute: bool = False
    timeline_dir: str | None = None
    # --hetero-expert-precision: the expert ranks' precision; None: the world's (--bf16/--fp16,
    # which the attention ranks run). See PoolPrecision.
    expert_precision: str | None = None
    # --hetero-zebra-issuer: who issues zebra's transfers (schedules/issuer.py resolve_issuer).
    zebra_issuer: str = "auto"
    # --hetero-expert-load-stats: where the measured expert loads go at every log interval
    # (docs/expert-load.md); None: beside the timeline (timeline_dir/expert_load.json) or nowhere.
    expert_load_stats: str | None = None
    # --hetero-replan-interval K: every K steps the ranks agree on a new expert placement from the
    # measured loads and move experts live when it pays (training/replan.py); 0: never.
    # --hetero-replan-margin: how many times the move's cost the predicted saving must exceed.
    replan_interval: int = 0
    replan_margin: float = 2.0

    def __post_init__(self) -> None:
        if type(self.replan_interval) is not int or self.replan_interval < 0:
            raise ValueError(f"--hetero-replan-interval {self.replan_interval!r}: give a number of steps >= 1 (0: "
                             f"never re-place experts)")
        if not self.replan_margin >= 0:
            raise ValueError(f"--hetero-replan-margin {self.replan_margin!r}: give a factor >= 0")
        if self.zebra_issuer not in ISSUERS:
            raise ValueError(f"--hetero-zebra-issuer {self.zebra_issuer!r} is unknown; use one of {list(ISSUERS)}")
        if self.expert_precision not in (None, "bf16", "fp16", "fp32"):
            raise ValueError(f"--hetero-expert-precision {self.expert_precision!r} is unknown; use bf16, fp16 or fp32")

    def pools(self, cfg: "TrainConfig") -> "PoolPrecision":
        """Each pool's precision: the attention ranks run the world's, the expert ranks this."""
        return PoolPrecision(cfg.precision, self.expert_precision or cfg.precision)


@dataclass(frozen=True)
class PoolPrecision:
    """The precision of each pool of a HeterMoE world: the attention ranks run the world's
    (--bf16/--fp16), the expert ranks --hetero-expert-precision (e.g. bf16 on A100 attention
    ranks, fp16 on V100 expert ranks, which have no native bf16).

    - Tokens cross roles in one wire dtype, the expert pool's: the attention ranks (the newer
      GPUs) cast at the boundary, both ways, and an attention rank's own experts (Asym-EA)
      receive and send in it too (parallel/transport.py SplitRoute).
    - With fp16 on either pool the world takes Megatron's fp16 loss scaling (dynamic from
      --initial-loss-scale unless --loss-scale): gradients cross in fp16 scaled, so the bf16
      pool's optimizer holds the same scale (training/step.py build_optimizer) and every rank
      skips the same steps (share_loss_scale).
    - Pools that differ are both 16-bit (training/validation.py check_pools)."""
    attention: str
    expert: str

    @property
    def mixed(self) -> bool:
        return self.attention != self.expert

    @property
    def wire(self) -> str:
        return self.expert

    def of(self, role: str) -> str:
        return self.attention if role == Role.ATTENTION else self.expert

    def dynamic_scale(self, loss_scale: float | None) -> bool:
        """Whether the world's loss scale is dynamic (fp16 somewhere, no --loss-scale)."""
        return "fp16" in (self.attention, self.expert) and loss_scale is None
