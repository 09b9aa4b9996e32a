"""The model per role: builder.py (model YAML or Megatron's flags -> TransformerConfig / GPTModel,
the kernels, layout-invariant weights), moe_layer.py (HeteroMoELayer, installed through the layer
spec), dispatcher.py (HeteroTokenDispatcher and its frozen per-microbatch DispatchMeta),
experts.py (expert compute and the expert ranks' ExpertRuntime), expert_axis.py (an experts
module's checkpoint keys renumbered to the plan's expert ids), tp_shards.py (a canonical tensor
<-> a tensor-parallel rank's shard), stages.py (the only place that cuts megatron's layers into
zebra's stages). Parameter names of every expert kernel are plan/expert_names.py's."""
