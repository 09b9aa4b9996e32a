"""Emulated mixed clusters on CPU ranks (`--emulate`): emulator.py (compute and links timed as the
emulated GPUs), timing.py (the executors' TaskTiming for an emulated cluster), megatron_ep.py
(plain Megatron EP timed the same way, through module hooks), validity.py (the bound on a run's
timing error, and whether it can be trusted), tuning.py (what keeps a rank's host delays small),
clock.py (emulated time's primitive)."""
