"""Checkpoints in Megatron's directory layout: format.py (names, manifest, rank payload, file
checks), save.py (atomic save), load.py (compatibility checks, load), reshard.py (load another
layout by canonical parameter name), hooks.py (what the trainers call), export.py (`hetermoe
checkpoint`: HeterMoE <-> plain Megatron)."""
