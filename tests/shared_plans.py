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
