"""The closed vocabularies of a run: a rank's role, a schedule's name, a task's kind, the stream
it runs on, the CP communication. StrEnums, so that a member equals, hashes and formats as its
value: plans, manifests, logs and Megatron's args keep the plain strings they always had, and code
compares against the members (tests/test_imports.py refuses a comparison with the bare string). Ground layer: no torch.
"""
from __future__ import annotations

from enum import StrEnum


class Word(StrEnum):
    """A member of a closed vocabulary: equal to, hashed and printed as its value."""

    def __repr__(self) -> str:
        # the plain string's: a message that quotes a role, schedule or kind with !r reads the same
        # whether the value came from a file (a str) or from the code (a member)
        return repr(self.value)


class Role(Word):
    """A rank's part in a run: HeterMoE's attention or expert rank (read from the plan), or a rank of
    plain Megatron EP (the reference). Logs, timelines, NaN reports and checkpoints name it."""
    ATTENTION = "attention"
    EXPERT = "expert"
    MEGATRON = "megatron"


class ScheduleName(Word):
    """A HeterMoE schedule's name; plan.tasks.SCHEDULES maps each to its task lists."""
    DISTEP = "distep"  # each microbatch's whole forward then backward, no overlap of the roles
    ZEBRA = "zebra"  # Theorem 1's order: attention and experts overlap


class TaskKind(Word):
    """What one entry of a rank's task list does (plan/tasks.py's docstring has the full notation)."""
    A_F = "A_F"  # attention stage forward (attention rank)
    A_B = "A_B"  # attention stage backward
    X_F = "X_F"  # an attention rank's own experts of a layer (Asym-EA), forward
    X_B = "X_B"
    E_F = "E_F"  # an expert rank's experts of a layer, forward
    E_B = "E_B"
    D_F = "D_F"  # dispatch: routed tokens to the experts' holders
    D_B = "D_B"  # backward of dispatch: token gradients back to the attention ranks
    C_F = "C_F"  # combine: expert outputs back to the attention ranks
    C_B = "C_B"  # backward of combine: output gradients to the experts' holders
    P_F = "P_F"  # pipeline: a stage's output to the next stage
    P_B = "P_B"  # pipeline: the gradient of a stage's input to the previous stage


class StreamName(Word):
    """Where a task runs: the compute stream, or one of the transfer streams."""
    COMPUTE = "compute"
    DISPATCH = "dispatch"  # attention -> expert direction (D_F, C_B)
    COMBINE = "combine"  # expert -> attention direction (C_F, D_B)
    PIPELINE = "pipeline"  # between pipeline stages (P_F, P_B)


class CpComm(Word):
    """Megatron's --cp-comm-type (TransformerConfig.cp_comm_type): how context-parallel ranks exchange
    what attention needs (models/context_attention.py)."""
    P2P = "p2p"  # a ring of key/value blocks (Megatron's default)
    ALL_GATHER = "all_gather"  # keys and values gathered
    A2A = "a2a"  # Ulysses: heads scattered, the sequence gathered
    A2A_P2P = "a2a+p2p"  # transformer-engine's hierarchical CP (not built on the local core)
