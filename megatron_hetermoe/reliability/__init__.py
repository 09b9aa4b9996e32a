"""Failing clearly: faults.py (fault injection points used by tests), collective_trace.py (every
collective a rank enters, $HETERMOE_TRACE_COLLECTIVES, and the check that ranks sharing a group
enter them in one order). The NaN check is training/nan_check.py."""
