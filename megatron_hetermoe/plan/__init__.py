"""The plan and what is read from it: hetero_plan.py (GPU type per rank, ZP groups of M attention +
N expert ranks, expert placement per layer; a rank's role is read here), layout.py (a plain
Megatron state dict <-> the per-rank layout of a plan), validation.py (every input checked
before any process group exists). No torch at import."""
