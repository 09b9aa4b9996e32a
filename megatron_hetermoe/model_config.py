"""Model shape as a YAML-backed dataclass, and its megatron-core TransformerConfig."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from .paths import resolve_config


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
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in ("name", "moe_aux_loss_coeff") and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"model {self.name!r}: {f.name}={v!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides it"
            )
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(
                f"model {self.name!r}: moe_router_topk={self.moe_router_topk} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"model {self.name!r}: moe_aux_loss_coeff={self.moe_aux_loss_coeff} < 0")

    @classmethod
    def load(cls, path_or_name: str | Path) -> "ModelConfig":
        path = resolve_config(str(path_or_name), "models")
        raw = yaml.safe_load(path.read_text()) or {}
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"{path}: unknown model field(s) {sorted(unknown)}; known: {sorted(names)}")
        missing = {f.name for f in fields(cls) if f.default is dataclasses.MISSING} - set(raw)
        if missing:
            raise ValueError(f"{path}: missing model field(s) {sorted(missing)}")
        return cls(**raw)

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
