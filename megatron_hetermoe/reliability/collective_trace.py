"""A trace of every collective a rank enters, to prove (or find where not) that every member of
every process group enters the same collectives in the same order, each group from one thread
at a time. That is what makes a job free of collective-order hangs; a violation shows up here as
the first (group, position) where two members disagree, in any run, not only in the rare run
whose timing turns it into a hang.

$HETERMOE_TRACE_COLLECTIVES=DIR makes shims/torch_distributed.py `trace_collectives()` (called by
both trainers at rank start) wrap torch.distributed's collectives in this process (`traced`);
each rank writes DIR/collectives.rank<R>.jsonl, one line per outermost collective call: the
group's name (torch names every group alike on all its members, in creation order), its global
ranks, the op, the calling thread, start and end, and the innermost calling frames outside torch.
`check(DIR)` reads the files and returns every violation:
- order: for a group, the members' sequences of ops differ (the first differing position);
- threads: two threads of one rank were inside collectives of one group at once (the order
  between them is then up to the scheduler);
- stuck: a collective a rank entered and never left (a hang's trace: where each rank waits).
Point-to-point ops (send/recv and their async forms) are recorded but not compared: their two
ends name different ops by design. Costs nothing unless the variable is set.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import threading
import time
from pathlib import Path

ENV = "HETERMOE_TRACE_COLLECTIVES"
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_object", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

_installed: Path | None = None
_seq = itertools.count()
_local = threading.local()  # depth: a collective that calls another (all_gather_object) is recorded once
_lock = threading.Lock()


def trace_file(rank: int | None = None) -> tuple[Path | None, bool]:
    """(this rank's trace file, whether it is new): (None, False) without $HETERMOE_TRACE_COLLECTIVES,
    (the file, False) when this process traces already, else a new empty file, to be made the
    trace with `started` once the collectives are wrapped (shims/torch_distributed.py
    trace_collectives does both)."""
    out = os.environ.get(ENV)
    if not out:
        return None, False
    import torch.distributed as dist

    if _installed is not None:
        return _installed, False
    rank = dist.get_rank() if rank is None else rank
    path = Path(out) / f"collectives.rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path, True


def started(path: Path) -> None:
    """This process's collectives are wrapped (`traced`) and write into `path`."""
    global _installed
    _installed = path


# Megatron binds some collectives to module names at import (its DDP's bucket reduce-scatter and
# all-gather with the distributed optimizer); those calls would escape a trace of torch.distributed.
ALIASES = {"megatron.core.distributed.param_and_grad_buffer": ("dist_reduce_scatter_func", "dist_all_gather_func")}


def _group_of(args: tuple, kwargs: dict, name: str):
    import torch.distributed as dist

    group = kwargs.get("group")
    if group is None and name == "batch_isend_irecv" and args:
        group = getattr(args[0][0], "group", None) if args[0] else None
    return group if group is not None else dist.group.WORLD


def traced(fn, name: str, path: Path):
    """`fn` (torch.distributed's `name`), recording each outermost call into `path`."""
    import torch.distributed as dist

    @functools.wraps(fn)
    def call(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        if depth:
            return fn(*args, **kwargs)
        group = _group_of(args, kwargs, name)
        rec = {"group": getattr(group, "group_name", str(group)), "ranks": dist.get_process_group_ranks(group),
               "op": name, "thread": threading.current_thread().name, "caller": _caller()}
        if name in POINT_TO_POINT:
            rec["p2p"] = _p2p_ops(name, args, kwargs, group)
        with _lock:  # the entry is written before the call: a collective that never returns shows
            seq = next(_seq)
            _write(path, {"seq": seq, **rec, "start": time.monotonic()})
        _local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth
            with _lock:
                _write(path, {"seq": seq, "end": time.monotonic()})

    call._hetermoe_traced = True
    return call


def _p2p_ops(name: str, args: tuple, kwargs: dict, group) -> list[list]:
    """A point-to-point call's operations as [send or recv, peer's global rank, tag], in order."""
    import torch.distributed as dist

    def one(op: str, peer, group_peer, tag) -> list:
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(group, group_peer)
        return ["send" if op in ("send", "isend") else "recv", peer, tag]

    if name == "batch_isend_irecv":
        return [one(o.op.__name__, o.peer, getattr(o, "group_peer", None), o.tag) for o in args[0]]
    peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    group_peer = kwargs.get("group_dst", kwargs.get("group_src"))
    return [one(name, peer, group_peer, kwargs.get("tag", args[3] if len(args) > 3 else 0))]


def _write(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _read(path: Path) -> list[dict]:
    """A rank's collectives in entry order, each with its end (None: it never returned)."""
    recs: dict[int, dict] = {}
    for ln in path.read_text().splitlines():
        r = json.loads(ln)
        if "op" in r:
            recs[r["seq"]] = {**r, "end": None}
        elif r["seq"] in recs:
            recs[r["seq"]]["end"] = r["end"]
    return [recs[k] for k in sorted(recs)]


def _caller() -> list[str]:
    """Where the collective was called from: the innermost frames outside torch (file:line)."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
    return [f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:]]


def check(trace_dir: str | os.PathLike) -> list[str]:
    """Every order or thread violation in a job's traces (empty: none)."""
    files = sorted(Path(trace_dir).glob("collectives.rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no collectives.rank*.jsonl in {trace_dir}; run with ${ENV}={trace_dir}")
    by_rank = {int(f.name[len("collectives.rank"):-len(".jsonl")]): _read(f) for f in files}
    problems: list[str] = []
    seqs: dict[str, dict[int, list[str]]] = {}
    members: dict[str, list[int]] = {}
    for rank, recs in by_rank.items():
        for r in recs:
            members[r["group"]] = r["ranks"]
            if r["op"] not in POINT_TO_POINT:
                seqs.setdefault(r["group"], {}).setdefault(rank, []).append(r["op"])
        problems += _overlapping_threads(rank, recs)
    for group, per_rank in sorted(seqs.items()):
        traced = [r for r in members[group] if r in by_rank]
        ref_rank = traced[0]
        ref = per_rank.get(ref_rank, [])
        for r in traced[1:]:
            got = per_rank.get(r, [])
            if got != ref:
                i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                problems.append(f"order: group {group} (ranks {members[group]}): collective #{i} is "
                                f"{ref[i] if i < len(ref) else 'none'} on rank {ref_rank} but "
                                f"{got[i] if i < len(got) else 'none'} on rank {r} ({len(ref)} vs {len(got)} in all)")
    for rank, recs in sorted(by_rank.items()):
        for r in recs:
            if r["end"] is None:
                problems.append(f"stuck: rank {rank} entered {r['op']} on group {r['group']} (ranks {r['ranks']}) "
                                f"from {' < '.join(reversed(r['caller']))} and never left it")
    return problems


def _overlapping_threads(rank: int, recs: list[dict]) -> list[str]:
    out = []
    by_group: dict[str, list[dict]] = {}
    for r in recs:
        by_group.setdefault(r["group"], []).append(r)
    for group, rs in by_group.items():
        rs = sorted(rs, key=lambda r: r["start"])
        open_: list[dict] = []
        for r in rs:
            open_ = [o for o in open_ if o["end"] is None or o["end"] > r["start"]]
            clash = next((o for o in open_ if o["thread"] != r["thread"]), None)
            if clash is not None:
                out.append(f"threads: rank {rank}, group {group}: {clash['op']} on thread {clash['thread']} and "
                           f"{r['op']} on thread {r['thread']} at once")
                break
            open_.append(r)
    return out


def single_queue_hangs(trace_dir: str | os.PathLike) -> list[str]:
    """Where a job's traced calls would hang on the worst device: every rank runs its calls in the
    order it entered them, one at a time, each blocking until it completes (one hardware queue:
    CUDA_DEVICE_MAX_CONNECTIONS=1); a collective completes once every member entered it (the
    members' k-th calls of a group meet); a point-to-point call (a batch_isend_irecv posts its
    operations together) once each of its operations' counterparts was posted (the k-th send from
    A to B with a tag meets the k-th receive at B from A with that tag), as NCCL's large messages
    need. Empty: no hang; else where each stuck rank waits."""
    files = sorted(Path(trace_dir).glob("collectives.rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no collectives.rank*.jsonl in {trace_dir}; run with ${ENV}={trace_dir}")
    calls = {int(f.name[len("collectives.rank"):-len(".jsonl")]): _read(f) for f in files}
    key: dict[tuple[int, int], tuple] = {}  # (rank, index) -> the meeting a call waits at
    seen: dict[tuple, int] = {}
    where: dict[tuple, tuple[int, int]] = {}  # a p2p operation -> (rank, index) of the call that posts it
    for rank, recs in calls.items():
        for i, r in enumerate(recs):
            if "p2p" not in r:
                n = seen[(rank, r["group"])] = seen.get((rank, r["group"]), 0) + 1
                key[(rank, i)] = ("collective", r["group"], n)
                continue
            ops = []
            for kind, peer, tag in r["p2p"]:
                src, dst = (rank, peer) if kind == "send" else (peer, rank)
                c = (kind, src, dst, tag)
                n = seen[c] = seen.get(c, 0) + 1
                where[(kind, src, dst, tag, n)] = (rank, i)
                ops.append(("recv" if kind == "send" else "send", src, dst, tag, n))
            key[(rank, i)] = ("p2p", tuple(ops))
    members = {g: set(r["ranks"]) for recs in calls.values() for r in recs if "p2p" not in r for g in [r["group"]]}
    pos = {r: 0 for r in calls}
    while True:
        moved = False
        at: dict[tuple, set[int]] = {}
        for rank, recs in calls.items():
            if pos[rank] < len(recs):
                at.setdefault(key[(rank, pos[rank])], set()).add(rank)
        for k, ranks in at.items():
            if k[0] == "collective":
                if ranks >= members[k[1]] & set(calls):
                    for r in ranks:
                        pos[r] += 1
                    moved = True
                continue
            for rank in ranks:  # each counterpart posted: its call reached (it may wait there itself)
                if all(c in where and pos[where[c][0]] >= where[c][1] for c in k[1]):
                    pos[rank] += 1
                    moved = True
        if not moved:
            break
    return [f"rank {r} waits at its call #{pos[r]}: {calls[r][pos[r]]['op']} on group {calls[r][pos[r]]['group']}"
            f"{' ' + str(calls[r][pos[r]]['p2p']) if 'p2p' in calls[r][pos[r]] else ''}"
            for r in sorted(calls) if pos[r] < len(calls[r])]
