"""The CPU demo (`make demo`): Megatron-Core trains a tiny Mixtral-style MoE on 4 CPU ranks
(EP=2, DP=2, alltoall dispatcher) and prints Megatron-style iteration lines.

Later stages of the project replace this with the HeterMoE run on an emulated mixed cluster;
until then it shows the baseline every HeterMoE feature is compared against.
"""
import sys

import megatron.core  # noqa: F401  - import once, then fork the ranks

from megatron_hetermoe.trainer import main

if __name__ == "__main__":
    sys.exit(main(["--nproc", "4", "--expert-model-parallel-size", "2", "--train-iters", "40",
                   "--lr", "3e-3", "--log-interval", "5"] + sys.argv[1:]))
