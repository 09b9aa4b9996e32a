"""Failing clearly: nan_check.py (Megatron's --check-for-nan-in-loss-and-grad, world-wide),
faults.py (fault injection points used by tests)."""
