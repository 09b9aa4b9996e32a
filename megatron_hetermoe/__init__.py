"""megatron-hetermoe: HeterMoE (arXiv 2504.03871) as a Megatron-Core plugin."""

__version__ = "0.1.0"
