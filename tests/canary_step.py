"""One Megatron MoE train step on 2 gloo ranks (EP=2, alltoall dispatcher). test_cpu_backend.py
runs it in a fresh interpreter with HETERMOE_CPU_PATCHES_SKIP naming a patch to leave out."""
import megatron.core  # noqa: F401  - import before forking ranks

from megatron_hetermoe.config import ModelConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.training.args import run

out = run(TrainConfig(ModelConfig.load("tiny"), ParallelConfig(ep=2), train_iters=1, quiet=True,
                      micro_batch_size=2, global_batch_size=4), nproc=2, timeout_s=120)
print("CANARY-OK", out.losses)
