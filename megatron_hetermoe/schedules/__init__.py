"""Schedules: executor.py (runs a rank's task list of plan/tasks.py: compute in order, transfers on
stream threads), issuer.py (the single issuer: one thread issues every collective asynchronously
in the rank's issue order), zebra.py (attention and expert ranks under zebra), distep.py (the
expert ranks' mirror of Megatron's schedule, 1F1B and interleaved included), select.py
(get_forward_backward_func for a hetero rank, megatron-core's signature), timing.py (the
TaskTiming seam), timeline.py (what a rank ran, for `hetermoe timeline`)."""
