"""A small emulated cluster and model shared by the expert-load emulation tests: 1 A40 + 2 V100,
a 2-layer model of 4 experts (top-2) wide enough that the emulated times dwarf CPU noise."""
CLUSTER = """name: a40-2v100
node_groups:
  - {gpu: A40, nodes: 1, gpus_per_node: 1, nic_gbps_per_gpu: 100}
  - {gpu: V100-16GB, nodes: 1, gpus_per_node: 2, nic_gbps_per_gpu: 100}
network_latency_us: 10
"""
MODEL = """name: small-moe-4e
num_layers: 2
hidden_size: 1024
num_attention_heads: 8
ffn_hidden_size: 3584
moe_ffn_hidden_size: 3584
num_experts: 4
moe_router_topk: 2
moe_aux_loss_coeff: 0.0
vocab_size: 32000
seq_length: 1024
"""
SEQ, GB = 1024, 4
