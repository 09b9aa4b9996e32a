"""The single issuer's issue order (plan/issue_order.py) under the worst device: every rank runs
its sequence strictly in order, one item at a time (CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware
queue), every collective waits until all its members reached it, a pipeline send waits until its
receiver posted the matching receive (NCCL above its in-flight buffer), and every A task may hold a
collective over all attention ranks of its stage (tensor parallelism, the global aux loss,
overlapped gradient reduction). `rendezvous` runs the whole world that way; it must finish."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.issue_order import (
    Counts,
    IssueOrderError,
    PipeCall,
    PipeMessage,
    _calls_of_pair,
    issue_sequence,
    stage_messages,
)
from megatron_hetermoe.plan.tasks import PipeTask, Task, check_stream_order, inputs, task_layers, zebra_tasks
from shared_plans import sparse_asym_ea_plan


def _key(plan, rank: int, item):
    """The rendezvous an item waits at (None: local work)."""
    g, s = plan.group_of(rank), plan.stage_of(rank)
    if isinstance(item, PipeCall):
        # the pair of ranks that post it (with virtual stages stage P - 1's next is stage 0)
        pipe = next(p for p in plan.attention_pipelines(g) if rank in p)
        peer = pipe[(s + item.peer) % plan.pipeline_stages]
        return ("pipe", g, frozenset((rank, peer)), frozenset(repr(m.task) for m in item.messages))
    if isinstance(item, Counts) or item.is_comm:
        return ("zp", g, s, repr(item))
    if item.kind in ("A_F", "A_B"):  # may hold a collective over the stage's attention ranks
        return ("attn", s, repr(item))
    return None


def rendezvous(plan, sequences: dict[int, list]) -> None:
    """Run every rank's sequence with rendezvous semantics; raise naming the heads on a deadlock."""
    members: dict = {}
    for r, seq in sequences.items():
        for it in seq:
            k = _key(plan, r, it)
            if k is not None:
                members.setdefault(k, set()).add(r)
    pos = {r: 0 for r in sequences}
    while True:
        moved = False
        for r, seq in sequences.items():  # local work never waits
            while pos[r] < len(seq) and _key(plan, r, seq[pos[r]]) is None:
                pos[r] += 1
                moved = True
        at: dict = {}
        for r, seq in sequences.items():
            if pos[r] < len(seq):
                at.setdefault(_key(plan, r, seq[pos[r]]), set()).add(r)
        for k, ranks in at.items():
            if ranks == members[k]:
                for r in ranks:
                    pos[r] += 1
                moved = True
        if not moved:
            break
    stuck = {r: sequences[r][pos[r]] for r in sequences if pos[r] < len(sequences[r])}
    assert not stuck, f"deadlock: ranks wait at {stuck}"


def _lists_keep_their_dependencies(plan, rank: int, seq: list) -> None:
    """A rank's sequence holds its task list (compute in list order, every transfer of its group)
    and never puts a compute before the transfer it reads."""
    tasks = zebra_tasks(plan, rank)
    assert [t for t in seq if isinstance(t, Task) and not t.is_comm] == [t for t in tasks if not t.is_comm]
    assert sorted(map(repr, (t for t in seq if isinstance(t, Task) and t.is_comm))) == \
        sorted(map(repr, (t for t in tasks if t.is_comm)))
    L = task_layers(plan, plan.stage_of(rank))
    seen: set = set()
    for it in seq:
        if isinstance(it, Task) and not it.is_comm:
            need = inputs(it, L)
            assert need is None or need in seen, (rank, it, need)
        if isinstance(it, Task) and it.kind == "D_F":
            assert Counts(it.layer, it.microbatch) in seen, (rank, it)
        seen.add(it)


def _check(plan, R: int | None = None) -> dict[int, list]:
    seqs = {r: issue_sequence(plan, r, R) for r in range(plan.world_size)}
    for r, seq in seqs.items():
        _lists_keep_their_dependencies(plan, r, seq)
    rendezvous(plan, seqs)
    return seqs


def test_every_member_of_a_group_issues_its_collectives_in_one_order():
    plan = sparse_asym_ea_plan()
    seqs = _check(plan)
    ops = {r: [it for it in s if isinstance(it, Counts) or it.is_comm] for r, s in seqs.items()}
    assert ops[0] == ops[1] == ops[2] == ops[3]
    # the attention ranks' A tasks sit at the same places among them (rank 1 also has X tasks)
    shared = {r: [repr(it) for it in s if isinstance(it, Counts) or it.kind not in ("X_F", "X_B")]
              for r, s in seqs.items() if r in (0, 1)}
    assert shared[0] == shared[1]


def test_a_payload_waits_a_compute_after_its_counts():
    """The host enqueues the next attention piece before it waits for a D_F's counts."""
    plan = even_plan(2, 4, 1, 1, num_microbatches=3, schedule="zebra")
    seq = issue_sequence(plan, 0)
    i = seq.index(Counts(0, 0))
    assert seq[i + 1] == Task("A_F", 0, 1) and seq[i + 2] == Task("D_F", 0, 0)


def test_the_1f1b_crossing_is_one_call_on_both_stages():
    """Stage 0 sends P_F(0,1) then receives P_B(1,0); stage 1 sends P_B(1,0) then receives P_F(0,1):
    unbatched, each send waits for a receive queued behind the other's send."""
    plan = even_plan(4, 4, 1, 1, num_microbatches=4, schedule="zebra", pipeline_stages=2, zebra_waves=4,
                     zebra_wave_order="1f1b")
    seqs = _check(plan)
    f1, b0 = PipeTask("P_F", 0, 1), PipeTask("P_B", 1, 0)
    up = [c for c in seqs[0] if isinstance(c, PipeCall) and f1 in [m.task for m in c.messages]]
    low = [c for c in seqs[2] if isinstance(c, PipeCall) and f1 in [m.task for m in c.messages]]
    assert [m.task for m in up[0].messages] == [m.task for m in low[0].messages] == [b0, f1]
    assert [m.send for m in up[0].messages] == [False, True] and [m.send for m in low[0].messages] == [True, False]


def test_unbatched_crossing_deadlocks_in_the_checker():
    """The checker is strict enough: the same stages with every message its own call deadlock."""
    plan = even_plan(4, 4, 1, 1, num_microbatches=4, schedule="zebra", pipeline_stages=2, zebra_waves=4,
                     zebra_wave_order="1f1b")
    seqs = {r: issue_sequence(plan, r) for r in range(plan.world_size)}
    unbatched = {}
    for r, seq in seqs.items():
        out = []
        for it in seq:
            if isinstance(it, PipeCall):
                # as the runtime issued them before: each message alone, at its own place: sends
                # first (right after their producer), receives after
                out += [PipeCall(m.peer, (m,)) for m in sorted(it.messages, key=lambda m: not m.send)]
            else:
                out.append(it)
        unbatched[r] = out
    with pytest.raises(AssertionError, match="deadlock"):
        rendezvous(plan, unbatched)


def test_calls_of_a_pair_by_hand():
    F = lambda j: PipeTask("P_F", 0, j)  # noqa: E731
    B = lambda j: PipeTask("P_B", 1, j)  # noqa: E731
    up = [(0.5, PipeMessage(F(0), True, 1)), (1.5, PipeMessage(F(1), True, 1)), (1.5, PipeMessage(B(0), False, 1))]
    low = [(-0.5, PipeMessage(F(0), False, -1)), (2.5, PipeMessage(B(0), True, -1)),
           (2.5, PipeMessage(F(1), False, -1))]
    a, b = _calls_of_pair(up, low, 0)
    assert [(k, [m.task for m in c.messages]) for k, c in a] == [(0.5, [F(0)]), (1.5, [B(0), F(1)])]
    assert [(k, [m.task for m in c.messages]) for k, c in b] == [(-0.5, [F(0)]), (2.5, [B(0), F(1)])]
    # a receive needed before the send of its call exists: refused, not hung
    low_bad = [(-0.5, PipeMessage(F(0), False, -1)), (1.5, PipeMessage(F(1), False, -1)),
               (2.5, PipeMessage(B(0), True, -1))]
    up_bad = [(0.5, PipeMessage(F(0), True, 1)), (1.5, PipeMessage(B(0), False, 1)),
              (3.5, PipeMessage(F(1), True, 1))]
    with pytest.raises(IssueOrderError, match="needs a receive before a send"):
        _calls_of_pair(up_bad, low_bad, 0)


def test_stage_messages_follow_the_list():
    plan = even_plan(2, 4, 1, 1, num_microbatches=2, schedule="zebra", pipeline_stages=2)
    msgs = stage_messages(zebra_tasks(plan, 0), 0, 2, 1)
    assert [(m.send, m.task) for _, m in msgs] == [(True, PipeTask("P_F", 0, 0)), (True, PipeTask("P_F", 0, 1)),
                                                   (False, PipeTask("P_B", 1, 0)), (False, PipeTask("P_B", 1, 1))]


SHAPES = [dict(L=L, R=R, M=M, N=N, groups=G, P=P, W=W, order=o)
          for L, R, M, N, G, P, W, o in itertools.product((1, 2, 3), (1, 2, 4), (1, 2), (1, 2), (1, 2), (1, 2, 3),
                                                           (1, 2, 4), ("gpipe", "1f1b"))
          if R % W == 0 and (W == 1 or P > 1) and (o == "gpipe" or W > 1)]


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from(SHAPES), move=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1)), max_size=3))
def test_no_shape_deadlocks(shape, move):
    """Plans of every shape, with some experts moved onto attention ranks (Asym-EA: X tasks and
    attention ranks with different lists), finish under rendezvous semantics."""
    s = shape
    plan = even_plan(s["L"] * s["P"], 2 * s["N"], s["M"], s["N"], groups=s["groups"], num_microbatches=s["R"],
                     schedule="zebra", pipeline_stages=s["P"], zebra_waves=s["W"], zebra_wave_order=s["order"])
    _move_experts(plan, move)
    _check(plan)


def _move_experts(plan, move) -> None:
    for layer, member in move:  # one expert of `layer` onto attention member `member` in every group
        layer %= plan.num_layers
        for g in plan.groups:
            stage = plan.stage_of_layer(layer)  # layer: an MoE layer, as placement[layer]
            a, x = plan.stage_ranks(plan.groups.index(g), stage)
            place = g.placement[layer]
            donor = next((r for r in x if place.get(r)), None)
            if donor is None or member >= len(a):
                continue
            e, place[donor] = place[donor][-1], place[donor][:-1]  # lists may be shared between groups
            place[a[member]] = sorted(place.get(a[member], []) + [e])
    plan.validate()


VIRTUAL_SHAPES = [dict(C=C, R=R, M=M, groups=G, P=P, V=V, W=W, order=o, dense=d)
                  for C, R, M, G, P, V, W, o, d in itertools.product(
                      (1, 2), (1, 2, 4, 6), (1, 2), (1, 2), (2, 3, 4), (2, 3), (1, 2, 3, 4, 6), ("gpipe", "1f1b"),
                      (False, True))
                  if R % W == 0 and (o == "gpipe" or W > 1) and (not d or C == 2)]


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from(VIRTUAL_SHAPES),
       move=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1)), max_size=3))
def test_no_virtual_stage_shape_deadlocks(shape, move):
    """Virtual pipeline stages (the stages form a ring: stage P - 1's chunks send on to stage 0's
    next chunk): P 2..4 x V 2..3, 1 or 2 model layers a chunk (the first of every other chunk dense),
    waves in both orders, Asym-EA moves. Every ZP stage issues one collective order and the world
    finishes under rendezvous semantics (every call a rendezvous of its two ranks, a send waiting
    for its receive)."""
    s = shape
    P, V, C = s["P"], s["V"], s["C"]
    dense = [u * C for u in range(1, P * V, 2)] if s["dense"] else []
    plan = even_plan(P * V * C - len(dense), 4, s["M"], 1, groups=s["groups"], num_microbatches=s["R"],
                     schedule="zebra", pipeline_stages=P, virtual_stages=V, zebra_waves=s["W"],
                     zebra_wave_order=s["order"], dense_layers=dense)
    _move_experts(plan, move)
    for g in range(s["groups"]):
        for stage in range(P):
            check_stream_order({r: zebra_tasks(plan, r) for r in plan.stage_members(g, stage)})
    seqs = _check(plan)
    calls = [c for c in seqs[0] if isinstance(c, PipeCall)]
    assert calls, "stage 0 exchanges its chunks' activations in calls"


def test_ring_receives_left_at_their_consumers_deadlock_in_the_checker():
    """Why the ring's calls follow the data flow in rounds: the same sequences with each message its
    own call, every receive posted right before its consumer, close a cycle of stages each waiting
    to send to the next (P 3 x V 2, 3 waves of 2 microbatches)."""
    from megatron_hetermoe.plan.tasks import stage_transfers

    plan = even_plan(12, 4, 1, 1, num_microbatches=6, schedule="zebra", pipeline_stages=3, virtual_stages=2,
                     zebra_waves=3)
    seqs = _check(plan)
    late = {}
    for r, seq in seqs.items():
        if plan.role(r) != "attention":
            late[r] = seq
            continue
        stage, L = plan.stage_of(r), task_layers(plan, plan.stage_of(r))
        recvs, out = {}, []
        for it in seq:
            if isinstance(it, PipeCall):
                out += [PipeCall(m.peer, (m,)) for m in it.messages if m.send]
                recvs.update({m.task: PipeCall(m.peer, (m,)) for m in it.messages if not m.send})
                continue
            if isinstance(it, Task) and it.kind in ("A_F", "A_B"):
                recv, _ = stage_transfers(it, stage, plan.pipeline_stages, L)
                if recv is not None:
                    out.append(recvs.pop(recv))
            out.append(it)
        late[r] = out
    with pytest.raises(AssertionError, match="deadlock"):
        rendezvous(plan, late)
