"""Process groups at start-up (issue 43 item 10): a one-rank group costs no world-wide call per
rank. Every rank used to create every rank's one-rank group ("self[r]", and any other kind that is
one rank, e.g. the replica groups of a single ZP group), each a world-wide new_group: with an
eagerly initialised NCCL world, each an ncclCommSplit the whole world joins (1,024 of them at
1,024 ranks). Now a rank's one-rank group is made by the rank alone (gloo; lazily initialised
NCCL) or by one split of the world for every rank (eager NCCL: parallel/state.py OneRankGroups).

The counts come from initialize_hetero_parallel itself, run for every rank of 16- and 64-rank
plans in this process with torch.distributed's group calls replaced by recorders; a launched gloo
world checks that the groups made that way work.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import pytest
import torch

from megatron_hetermoe.parallel import state as st
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.parallel.layout import GROUP_KINDS, RankLayout, group_plan
from megatron_hetermoe.plan.hetero_plan import even_plan


@dataclass(frozen=True)
class _Group:
    ranks: tuple[int, ...]


class _Recorder:
    """torch.distributed as initialize_hetero_parallel sees it on rank `rank` of `world`, recording
    its group calls: ("world", ranks) for a new_group every rank must join, ("local", ranks) for
    one made by its members alone, ("split", n) for a split_group of the world into n groups."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.calls = rank, world, []

    def new_group(self, ranks, timeout=None, use_local_synchronization=False, **kw):
        ranks = sorted(ranks)
        self.calls.append(("local" if use_local_synchronization else "world", tuple(ranks)))
        if use_local_synchronization and self.rank not in ranks:
            raise AssertionError(f"rank {self.rank} joined the local creation of {ranks}")
        return _Group(tuple(ranks)) if self.rank in ranks else None

    def split_group(self, parent_pg=None, split_ranks=None, timeout=None, **kw):
        self.calls.append(("split", len(split_ranks)))
        return next(_Group(tuple(sorted(g))) for g in split_ranks if self.rank in g)


def _start(monkeypatch, plan, rank: int, how: st.OneRankGroups) -> tuple[_Recorder, st.HeteroParallelState]:
    rec = _Recorder(rank, plan.world_size)
    monkeypatch.setattr(st.dist, "get_world_size", lambda group=None: plan.world_size)
    monkeypatch.setattr(st.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(st.dist, "new_group", rec.new_group)
    monkeypatch.setattr(st.dist, "split_group", rec.split_group, raising=False)
    monkeypatch.setattr(st.dist, "get_process_group_ranks", lambda g: list(g.ranks))
    monkeypatch.setattr(st, "one_rank_groups", lambda: how)
    monkeypatch.setattr(st, "_ONE_RANK", {})  # a new process each time
    hs = st.initialize_hetero_parallel(plan, timeout=datetime.timedelta(seconds=60), device=torch.device("cpu"))
    return rec, hs


def _plan(world: int):
    """2 ZP groups of (world/2 - 2) attention + 2 expert ranks; with one ZP group the replica
    groups are one rank each too."""
    return even_plan(2, 8, world // 2 - 2, 2, groups=2)


def _world_wide(calls) -> list:
    return [c for c in calls if c[0] in ("world", "split")]


@pytest.mark.parametrize("how", [st.OneRankGroups.LOCAL, st.OneRankGroups.SPLIT])
def test_one_rank_groups_cost_no_world_wide_call_per_rank(monkeypatch, how):
    counts = {}
    for world in (16, 40):
        plan = _plan(world)
        calls = {}
        for rank in range(world):
            rec, hs = _start(monkeypatch, plan, rank, how)
            calls[rank] = rec.calls
            # the rank's groups are those of the plan: the rank alone for each one-rank kind
            lay = RankLayout(plan, rank)
            for kind in GROUP_KINDS:
                want = lay.ranks(kind)
                if want is not None:
                    assert hs.group(kind).ranks == tuple(want), (world, rank, kind)
        ww = [_world_wide(c) for c in calls.values()]
        assert all(w == ww[0] for w in ww), "ranks disagree on the world-wide calls: a hang on NCCL"
        assert not any(c[0] == "world" and len(c[1]) == 1 for c in ww[0])
        multi = [ranks for _, ranks in group_plan(plan) if len(ranks) > 1]
        assert [c for c in ww[0] if c[0] == "world"] == [("world", tuple(r)) for r in multi]
        if how is st.OneRankGroups.SPLIT:
            assert [c for c in ww[0] if c[0] == "split"] == [("split", world)]
        for rank, c in calls.items():
            local = [x for x in c if x[0] == "local"]
            assert local == ([("local", (rank,))] if how is st.OneRankGroups.LOCAL else []), (rank, local)
        counts[world] = (len(ww[0]), len(multi))
    # world-wide calls: the groups of two or more ranks (+1 split); nothing per rank
    for world, (n, multi) in counts.items():
        assert n == multi + (how is st.OneRankGroups.SPLIT), counts


def test_the_old_way_made_every_rank_join_every_one_rank_group(monkeypatch):
    """WORLD (eager NCCL without split_group) is what every world used to do: world-size calls."""
    plan = _plan(16)
    rec, _ = _start(monkeypatch, plan, 3, st.OneRankGroups.WORLD)
    ones = [c for c in rec.calls if c[0] == "world" and len(c[1]) == 1]
    assert ones == [("world", (r,)) for r in range(16)]


def test_the_creation_mode_follows_the_default_group(monkeypatch):
    class World:
        bound_device_id = None

    assert st.one_rank_groups(World()) is st.OneRankGroups.LOCAL  # gloo, or NCCL started lazily
    World.bound_device_id = torch.device("cuda", 0)
    assert st.one_rank_groups(World()) is st.OneRankGroups.SPLIT  # NCCL started eagerly
    monkeypatch.delattr(st.dist, "split_group")
    assert st.one_rank_groups(World()) is st.OneRankGroups.WORLD


# ---- real groups (gloo) ----------------------------------------------------------------------------
def _groups_work(rank: int, world: int) -> dict:
    import torch.distributed as dist

    calls = []
    new_group = dist.new_group

    def counting(ranks=None, *args, **kwargs):
        calls.append((tuple(sorted(ranks)), bool(kwargs.get("use_local_synchronization"))))
        return new_group(ranks, *args, **kwargs)

    dist.new_group = counting
    plan = even_plan(1, 4, 2, 2)  # one ZP group: its replica groups are one rank each
    hs = st.initialize_hetero_parallel(plan)
    again = st.initialize_hetero_parallel(plan)  # a second start in the same world reuses it
    sums = {}
    for kind in GROUP_KINDS:
        g = hs.group(kind)
        if g is None:
            continue
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        sums[kind] = t.item()
    return {"calls": calls, "sums": sums, "same": again.group("self") is hs.group("self"),
            "one": hs.group("self") is hs.group("replica")}


def test_one_rank_groups_work_and_are_made_by_the_rank_alone():
    plan = even_plan(1, 4, 2, 2)
    results = launch(_groups_work, plan.world_size, timeout_s=120)
    multi = [tuple(r) for _, r in group_plan(plan) if len(r) > 1]
    for rank, got in enumerate(results):
        lay = RankLayout(plan, rank)
        # every group of two or more ranks once per start, the rank's own one-rank group once
        assert got["calls"] == [((rank,), True)] + [(r, False) for r in multi] * 2, got["calls"]
        assert got["same"] and got["one"]
        for kind, total in got["sums"].items():
            assert total == sum(r + 1 for r in lay.ranks(kind)), (rank, kind, total)
