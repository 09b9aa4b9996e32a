"""The hand-sized model and GPU pair of the pipeline-stage planner tests (test_pipeline_stages_planner.py,
test_zebra_stages_sim.py): h=1024, 8 heads, 8 MoE layers of 8 experts, vocab 1000, 1K tokens."""
from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profiles

S = 1024
SMALL = ModelConfig(name="pp-small", num_layers=8, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=2048,
                    moe_ffn_hidden_size=512, num_experts=8, moe_router_topk=2, vocab_size=1000, seq_length=S)
GPUS = ("A40", "V100-16GB")


def cost(model: ModelConfig = SMALL, **kw) -> CostModel:
    return CostModel(model, load_profiles(set(GPUS)), TrainSettings(S, **kw))
