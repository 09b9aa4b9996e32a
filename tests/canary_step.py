"""One Megatron MoE train step on gloo ranks: 2 ranks (EP=2, alltoall dispatcher), or with the
argument `tp2` 4 ranks (TP=2 with sequence parallelism, EP=2). test_cpu_backend.py runs it in a
fresh interpreter with HETERMOE_CPU_PATCHES_SKIP naming a patch to leave out."""
import sys

import megatron.core  # noqa: F401  - import before forking ranks

from megatron_hetermoe.config import ModelConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.training.args import run

tp = 2 if sys.argv[1:] == ["tp2"] else 1
out = run(TrainConfig(ModelConfig.load("tiny"), ParallelConfig(tp=tp, ep=2, sequence_parallel=tp > 1), train_iters=1,
                      quiet=True, micro_batch_size=2, global_batch_size=4), nproc=2 * tp, timeout_s=120)
print("CANARY-OK", out.losses)
