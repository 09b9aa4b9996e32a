"""Model shape as a YAML-backed dataclass, and its megatron-core TransformerConfig."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path


from megatron_hetermoe.paths import read_yaml_mapping, resolve_config


class ModelConfigError(ValueError):
    """A model config that cannot be built; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """A Mixtral-style MoE GPT: every layer is MoE, SwiGLU experts, RMSNorm, RoPE, no bias."""

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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ModelConfigError(f"model name={self.name!r} must be a non-empty string")
        for f in fields(self):
            v = getattr(self, f.name)
            # bool is an int subclass: `num_layers: true` in YAML must not mean 1.
            if f.name not in ("name", "moe_aux_loss_coeff") and (type(v) is not int or v <= 0):
                raise ModelConfigError(f"model {self.name!r}: {f.name}={v!r} must be a positive integer")
        c = self.moe_aux_loss_coeff
        if type(c) not in (int, float) or not math.isfinite(c) or c < 0:
            raise ModelConfigError(f"model {self.name!r}: moe_aux_loss_coeff={c!r} must be a finite number >= 0 "
                                   f"(Megatron's default is 0.01; 0 disables the load-balancing loss)")
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides it"
            )
        if self.head_dim % 2:
            # RoPE rotates pairs of channels; an odd head dim fails inside the first forward.
            raise ModelConfigError(
                f"model {self.name!r}: head dim hidden_size/num_attention_heads = {self.hidden_size}/"
                f"{self.num_attention_heads} = {self.head_dim} is odd; RoPE needs an even head dim"
            )
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ModelConfigError(
                f"model {self.name!r}: moe_router_topk={self.moe_router_topk} must be in "
                f"[1, num_experts={self.num_experts}]"
            )

    @classmethod
    def load(cls, path_or_name: str | Path) -> "ModelConfig":
        path = resolve_config(str(path_or_name), "models")
        raw = read_yaml_mapping(path, "model config", ModelConfigError)
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ModelConfigError(f"{path}: unknown model field(s) {sorted(map(str, unknown))}; known: {sorted(names)}")
        missing = {f.name for f in fields(cls) if f.default is dataclasses.MISSING} - set(raw)
        if missing:
            raise ModelConfigError(f"{path}: missing model field(s) {sorted(missing)}")
        try:
            return cls(**raw)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def expert_params(self) -> int:
        """Parameters of one SwiGLU expert (fc1 is 2 x ffn for the gate and up projections)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def non_expert_params(self) -> int:
        """Embedding, output layer, attention, norms and routers: what an attention rank holds."""
        h, L = self.hidden_size, self.num_layers
        attn = 4 * h * h + 2 * h + h * self.num_experts  # qkv+proj, two norms, router
        return 2 * self.vocab_size * h + L * attn + h
