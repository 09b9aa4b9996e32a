"""Plans that several test modules train on."""
from __future__ import annotations

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup


def asym_ea_plan() -> HeteroPlan:
    """For the tiny model (2 layers, 4 experts): 2 ZP groups of 1 attention + 1 expert rank
    (ranks 0+1, 2+3), zebra, R=2. Each attention rank also holds one expert, a different one per
    layer (Asym-EA: X_F/X_B tasks and receive-only transfers), so no rank's experts are the
    contiguous block Megatron EP would give it."""
    def group(a: int, e: int) -> ZPGroup:
        return ZPGroup([a], [e], [{a: [0], e: [1, 2, 3]}, {a: [3], e: [0, 1, 2]}])

    return HeteroPlan(2, 4, ["cpu"] * 4, [group(0, 1), group(2, 3)], num_microbatches=2, schedule="zebra")


def sparse_asym_ea_plan(schedule: str = "zebra") -> HeteroPlan:
    """For the tiny model: one ZP group of 2 attention ranks (0, 1) + 2 expert ranks (2, 3), R=2.
    Only the second attention rank holds experts (expert 0 of layer 0, expert 3 of layer 1), so
    attention rank 0 steps a dense sub-optimizer only and rank 1 a dense and an expert one; expert
    rank 3 holds expert 3 of layer 0 and nothing at all in layer 1 (as Asym-EA's placement makes
    when it moves more than E-N experts of a layer)."""
    g = ZPGroup([0, 1], [2, 3], [{1: [0], 2: [1, 2], 3: [3]}, {1: [3], 2: [0, 1, 2]}])
    return HeteroPlan(2, 4, ["cpu"] * 4, [g], num_microbatches=2, schedule=schedule)


def attention_tp_pair_moves(schedule: str = "zebra") -> tuple[HeteroPlan, dict]:
    """For the tiny model: the attention pool one TP 2 pair (ranks 0, 1) and expert ranks 2, 3, R=4,
    and the live moves both hostings' tests force on it ({iteration: group 0's placement per
    layer}): one expert each way at 2; at 4, each expert rank holds nothing in one layer."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = even_plan(2, 4, 2, 2, groups=1, num_microbatches=4, schedule=schedule, attention_tp=2)
    return plan, {2: [{2: [0, 1, 2], 3: [3]}, {2: [0], 3: [1, 2, 3]}], 4: [{3: [0, 1, 2, 3]}, {2: [0, 1, 2, 3]}]}
