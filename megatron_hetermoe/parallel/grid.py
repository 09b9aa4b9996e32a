"""A named grid per pool (issue 45, item 2): the attention pool and the expert pool each as a
hyperrectangle of named axes, as megatron-core's HyperCommGrid describes one parallel job.

HyperCommGrid numbers its grid's positions rank_offset, rank_offset + 1, ...: a pool that is one
contiguous run of ranks. A HeterMoE plan interleaves its pools (each ZP group lists its attention
ranks, then its expert ranks, under any rank numbers), so a `PoolGrid` keeps HyperCommGrid's
arithmetic (axes named in megatron-core's order, the first varying fastest; a group along some
axes is every position that differs from one only there, enumerated as HyperCommGrid.get_rank_enum
does) and maps each position to the plan's rank there. tests/parallel/test_grid.py holds the
enumeration to HyperCommGrid's.

The pools (`plan_grids`), positions in the plan's own order:
- attention: `tp x cp x dp x pp x zp`: a member's TP ranks fastest, then its CP ranks (Megatron's
  tp-cp order), the members of one stage of a ZP group (dp), the stages (pp), the ZP groups (zp);
- expert: `ep x pp x zp`: one stage's expert ranks of a ZP group (the experts of a layer spread
  over them), the stages, the ZP groups.
Both share the outer `pp x zp`: a ZP group's dispatch unit at a stage is the two pools' ranks at
one (pp, zp).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.vocabulary import Role

ATTENTION_AXES = ("tp", "cp", "dp", "pp", "zp")
EXPERT_AXES = ("ep", "pp", "zp")
UNIT_AXES = ("pp", "zp")  # the axes both pools share: one dispatch unit per (pp, zp)


@dataclass(frozen=True)
class PoolGrid:
    """One pool's ranks as a grid of named axes, the first varying fastest (HyperCommGrid's
    convention): `ranks[p]` is the global rank at position p."""
    role: Role
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"{self.role} grid: axes {self.axes} and shape {self.shape} differ in length")
        if math.prod(self.shape) != len(self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"{self.role} grid of shape {dict(zip(self.axes, self.shape))} needs "
                             f"{math.prod(self.shape)} distinct ranks, got {list(self.ranks)}")

    @functools.cached_property
    def _strides(self) -> dict[str, int]:
        out, stride = {}, 1
        for axis, size in zip(self.axes, self.shape):
            out[axis] = stride
            stride *= size
        return out

    @functools.cached_property
    def _position(self) -> dict[int, int]:
        return {r: p for p, r in enumerate(self.ranks)}

    def size(self, axis: str) -> int:
        return self.shape[self._axis(axis)]

    def _axis(self, axis: str) -> int:
        if axis not in self.axes:
            raise KeyError(f"{self.role} grid has no axis {axis!r}; its axes are {self.axes}")
        return self.axes.index(axis)

    def _coords_at(self, p: int) -> dict[str, int]:
        return {a: p // self._strides[a] % n for a, n in zip(self.axes, self.shape)}

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate on every axis."""
        return self._coords_at(self._position[rank])

    def at(self, **coords: int) -> int:
        """The rank at the given coordinates (every axis named)."""
        if set(coords) != set(self.axes):
            raise KeyError(f"{self.role} grid: give a coordinate on each of {self.axes}, got {sorted(coords)}")
        return self.ranks[sum(c * self._strides[a] for a, c in coords.items())]

    def _offsets(self, axes: tuple[str, ...]) -> list[int]:
        """Position offsets of a group along `axes`, the first listed axis of the grid fastest."""
        ordered = [a for a in self.axes if a in axes]
        if len(ordered) != len(set(axes)):
            raise KeyError(f"{self.role} grid has no axis among {sorted(set(axes) - set(self.axes))}; "
                           f"its axes are {self.axes}")
        ranges = [range(0, self.size(a) * self._strides[a], self._strides[a]) for a in reversed(ordered)]
        return [sum(c) for c in itertools.product(*ranges)]

    def group(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """The ranks that differ from `rank` only along `axes`, in grid order (the first axis
        fastest): `rank`'s group along those axes."""
        offsets = self._offsets(axes)  # names a bad axis before anything else
        c, p = self.coords(rank), self._position[rank]
        base = p - sum(c[a] * self._strides[a] for a in axes)
        return [self.ranks[base + o] for o in offsets]

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group along `axes`, as HyperCommGrid.get_rank_enum lists them (the other axes'
        coordinates ascending, the first fastest; each group in grid order)."""
        offsets = self._offsets(axes)
        fixed = [p for p in range(len(self.ranks)) if not any(self._coords_at(p)[a] for a in axes)]
        return [[self.ranks[p + o] for o in offsets] for p in fixed]

    def where(self, **coords: int) -> list[int]:
        """The ranks at the given coordinates of some axes, in grid order (none in an empty pool: a
        plan without expert ranks)."""
        if not self.ranks:
            return []
        free = tuple(a for a in self.axes if a not in coords)
        base = {a: 0 for a in free} | coords
        return self.group(self.at(**base), free)


def plan_grids(plan: HeteroPlan) -> dict[Role, PoolGrid]:
    """The plan's attention and expert pools as grids (module docstring), positions in the plan's
    own order: ZP group by ZP group, stage by stage within one, a member's TP ranks fastest."""
    G, P = len(plan.groups), plan.pipeline_stages
    members = len(plan.groups[0].attention_ranks) // (P * plan.member_size)
    return {
        Role.ATTENTION: PoolGrid(Role.ATTENTION, ATTENTION_AXES, (plan.attention_tp, plan.attention_cp, members, P, G),
                                 tuple(plan.attention_ranks)),
        Role.EXPERT: PoolGrid(Role.EXPERT, EXPERT_AXES, (len(plan.groups[0].expert_ranks) // P, P, G),
                              tuple(plan.expert_ranks)),
    }
