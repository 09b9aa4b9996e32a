"""The largest job any cluster could hold: upper bounds on what a model, plan or job may ask for.

An input past these is a typo (`nodes: 1e9`, `num_layers: 1e20`, `--groups 1000000000`,
`--global-batch-size 1e15`), and the code it reaches allocates or loops in proportion (a placement
per layer per ZP group, a microbatch loop, a sample index): it is refused before any of that,
naming the bound. Each bound is far above what has been trained (the largest clusters run tens of
thousands of GPUs; published models have at most ~200 layers, 2048 experts per layer, 256K
vocabularies, 1M-token contexts, batches of tens of thousands of sequences). A leaf module.
"""
from __future__ import annotations

MAX_RANKS = 1 << 17  # GPUs in a cluster or ranks in a plan (131072)

# ModelConfig field -> its largest value.
MODEL_LIMITS = {
    "num_layers": 1 << 12,  # 4096
    "hidden_size": 1 << 17,
    "num_attention_heads": 1 << 12,
    "ffn_hidden_size": 1 << 20,
    "moe_ffn_hidden_size": 1 << 20,
    "moe_shared_expert_intermediate_size": 1 << 20,
    "num_experts": 1 << 14,  # 16384 per layer
    "moe_router_topk": 1 << 14,
    "vocab_size": 1 << 24,
    "seq_length": 1 << 24,  # 16M tokens
}

MAX_MICROBATCHES = 1 << 16  # per step and attention rank (a plan's R, or Megatron's microbatch count)
MAX_GLOBAL_BATCH = 1 << 24  # sequences per step (16.7M)
MAX_PLACEMENT_ENTRIES = 1 << 26  # ZP groups x layers x experts: the plan's placement tables (~GBs as JSON)
