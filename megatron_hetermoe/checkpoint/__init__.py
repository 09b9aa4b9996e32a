"""Checkpoints in Megatron's directory layout: format.py (names, manifest, rank payload, file
checks), save.py (atomic save), load.py (compatibility checks, load), reshard.py (load another
layout by canonical parameter name), lock.py (one run per --save directory), hooks.py (what the
trainers call), megatron_optimizer.py (Megatron's optimizer in Megatron's own dist_checkpointing
checkpoints on HeterMoE ranks), export.py (`hetermoe checkpoint`: HeterMoE <-> plain Megatron)."""
