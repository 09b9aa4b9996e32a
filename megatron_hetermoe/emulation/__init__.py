"""Emulated mixed clusters on CPU ranks: emulator.py (compute and links timed as the emulated
GPUs, validity of every run), clock.py (emulated time's primitive)."""
