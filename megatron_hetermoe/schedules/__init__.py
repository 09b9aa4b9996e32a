"""Schedules: tasks.py (Theorem 1's task lists, shared with the simulator; no torch), executor.py
(runs a task list: compute in order, transfers on streams), zebra.py (attention and expert
ranks under zebra), distep.py (the expert mirror of Megatron's schedule), select.py
(get_forward_backward_func for a hetero rank, megatron-core's signature)."""
