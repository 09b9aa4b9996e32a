"""The model per role: builder.py (model YAML -> TransformerConfig / GPTModel, the kernels,
layout-invariant weights), expert_names.py (every kernel's parameter names <-> canonical names),
moe_layer.py (HeteroMoELayer, installed through the layer spec), dispatcher.py
(HeteroTokenDispatcher and its frozen per-microbatch DispatchMeta), experts.py (expert compute
and the expert ranks' ExpertRuntime), stages.py (the only place that cuts megatron's layers into
zebra's stages)."""
