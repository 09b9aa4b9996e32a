"""The plan and what is read from it: hetero_plan.py (GPU type per rank, ZP groups of M attention +
N expert ranks, expert placement per layer, pipeline stages; a rank's role is read here), tasks.py
(Theorem 1's zebra task lists and the DistEP order, and the schedule registry SCHEDULES),
issue_order.py (one order of every collective and pipeline call per rank that all ranks sharing
it agree on), expert_names.py (every expert kernel's parameter names <-> canonical names),
layout.py (a plain Megatron state dict <-> the per-rank layout of a plan). hetero_plan.py,
tasks.py and issue_order.py import no torch."""
