"""One issue order per rank: every collective a zebra step issues, in an order that is the same
on every rank that shares it, whatever the device does with streams.

Why. On a GPU, collectives of different communicators are independent only while the device
runs their streams on separate hardware queues. With CUDA_DEVICE_MAX_CONNECTIONS=1 (which
Megatron-LM asks for with TP > 1 before Blackwell) every stream of a rank feeds one queue, so the
device runs the rank's work in the order the host issued it: if rank A issues X then Y while
rank B issues Y then X, both wait forever. The same holds for pipeline point-to-point traffic:
NCCL runs a pair's sends and receives on one stream, so stage 0 sending F1 then receiving B0
while stage 1 sends B0 then receives F1 deadlocks once a message exceeds NCCL's in-flight
buffer. So the single issuer (schedules/issuer.py) does not choose its order at run time; it
follows the sequence made here:

* `issue_sequence(plan, rank, R)`: the rank's compute tasks, counts exchanges (`Counts`), token
  transfers (Task) and pipeline calls (`PipeCall`) in the order the rank issues them.
* The sequences of a ZP group come from one zero-time simulation of its members' task lists
  (`_StageSim`): every member issues every collective of the group in the simulation's one
  order; compute tasks that may hold collectives among attention ranks (A_F/A_B: tensor
  parallelism, the global aux loss, Megatron's overlapped gradient reduction) and the pipeline
  calls are joint events of the stage's attention ranks, so their place against the group's
  collectives is the same on every attention rank. A collective starts in the simulation when
  every member reached it in its list, so each member's sequence keeps its list's dependencies
  (a transfer after the compute that fills it, a compute after the transfer it reads).
* Pipeline traffic between stages s and s+1 goes in calls (`pipe_calls`): both sides list the
  messages they exchange in the order their task lists reach them; where the two orders cross,
  the crossing messages form one call, issued as one batch (batch_isend_irecv: both directions
  posted together, as Megatron's send_forward_recv_backward), so both sides see the same
  sequence of calls. A call sits before its first receive's consumer, after its sends'
  producers; a crossing that no call can resolve is refused when the sequence is made.
* Together: each stage's sequence is a total order of its events, and a pair of stages orders
  the calls they share the same way; the stages of a pipeline form a chain, so one global order
  agrees with every rank's sequence, and issuing in it cannot wait in a cycle. With virtual
  stages the last stage's output goes on to the first (the next model chunk), so the stages form
  a ring (with two stages, one pair exchanging messages both ways): `pipe_calls` then checks
  that the stages' calls have one global order (`_check_ring`) and refuses the lists otherwise.

A D_F's payload needs its counts on the host; it is placed one simulated round after its
counts exchange, so the host enqueues the next compute task before it waits for them.
No torch here: the planner's simulator may read the same sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from megatron_hetermoe.plan.tasks import (
    ATTENTION_KINDS,
    Layers,
    PipeTask,
    Task,
    chunk_counts,
    inputs,
    stage_transfers,
    task_layers,
)
from megatron_hetermoe.vocabulary import TaskKind


@dataclass(frozen=True)
class Counts:
    """The counts exchange of D_F(layer, microbatch): every member's per-expert token counts to
    every member, on the ZP group's counts communicator."""
    layer: int
    microbatch: int

    def __repr__(self) -> str:
        return f"N({self.layer},{self.microbatch})"


@dataclass(frozen=True)
class PipeMessage:
    """One pipeline message seen from one side: `task` (P_F(s, j): stage s's output of microbatch
    j; P_B(s, j): the gradient of stage s's input), sent or received, with the previous (-1) or
    next (+1) stage (with virtual stages, stage P - 1's next is stage 0)."""
    task: PipeTask
    send: bool
    peer: int  # -1: the previous stage, +1: the next

    def __repr__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.task!r} {'prev' if self.peer < 0 else 'next'}"


@dataclass(frozen=True)
class PipeCall:
    """Pipeline messages with one neighbour, posted together (one batch_isend_irecv); both sides
    list them in one order, so NCCL matches each side's k-th operation with the other's."""
    peer: int
    messages: tuple[PipeMessage, ...]

    def receives(self) -> tuple[PipeMessage, ...]:
        return tuple(m for m in self.messages if not m.send)

    def __repr__(self) -> str:
        return "P[" + ", ".join(map(repr, self.messages)) + "]"


Issue = Union[Task, Counts, PipeCall]


class IssueOrderError(ValueError):
    """Task lists with no deadlock-free issue order (names what waits on what)."""


def _message_key(m: PipeTask) -> tuple:
    return (m.kind, m.layer, m.microbatch)


def stage_messages(tasks: list[Task], stage: int, stages: int, num_layers: Layers) -> list[tuple[float, PipeMessage]]:
    """The pipeline messages of an attention rank of `stage`, in the order its list reaches them,
    each with its key on the list's attention tasks (k-th A task: a receive before it has key
    k - 0.5, a send after it k + 0.5)."""
    out: list[tuple[float, PipeMessage]] = []
    k = -1
    for t in tasks:
        if t.kind not in ATTENTION_KINDS:
            continue
        k += 1
        recv, send = stage_transfers(t, stage, stages, num_layers)
        if recv is not None:
            out.append((k - 0.5, PipeMessage(recv, False, -1 if recv.kind == TaskKind.P_F else 1)))
        if send is not None:
            out.append((k + 0.5, PipeMessage(send, True, 1 if send.kind == TaskKind.P_F else -1)))
    return out


def _calls_of_pair(upper: list[tuple[float, PipeMessage]], lower: list[tuple[float, PipeMessage]],
                   stage: int) -> tuple[list[tuple[float, PipeCall]], list[tuple[float, PipeCall]]]:
    """The calls between stage `stage` (upper: its messages with the next stage) and stage+1
    (lower: its messages with the previous one), each side's with its key (module docstring)."""
    return _calls_between([m for m in upper if m[1].peer == 1], [m for m in lower if m[1].peer == -1],
                          f"pipeline stages {stage} and {stage + 1}")


def _calls_between(a: list[tuple[float, PipeMessage]], b: list[tuple[float, PipeMessage]],
                   pair: str) -> tuple[list[tuple[float, PipeCall]], list[tuple[float, PipeCall]]]:
    """The calls of two neighbours from the messages each exchanges with the other (`a`: the upper
    side's, `b`: the lower side's, each with its key, in list order)."""
    if sorted(_message_key(m.task) for _, m in a) != sorted(_message_key(m.task) for _, m in b):
        raise IssueOrderError(f"{pair} do not exchange the same messages: "
                              f"{[m for _, m in a]} vs {[m for _, m in b]}")
    out_a: list[tuple[float, PipeCall]] = []
    out_b: list[tuple[float, PipeCall]] = []
    i = j = 0
    while i < len(a):
        # The shortest prefixes of both sides that hold the same messages: one call.
        sa, sb = {a[i][1].task}, {b[j][1].task}
        i, j = i + 1, j + 1
        while sa != sb:
            if sb - sa:
                sa.add(a[i][1].task)
                i += 1
            else:
                sb.add(b[j][1].task)
                j += 1
        for side, seq, hi, out in (("upper", a, i, out_a), ("lower", b, j, out_b)):
            part = seq[hi - len(sa):hi]
            # Both sides post a call's messages in one canonical order (NCCL pairs a batch's
            # operations with one peer by their order).
            msgs = tuple(m for _, m in sorted(part, key=lambda km: _message_key(km[1].task)))
            recv_keys = [k for k, m in part if not m.send]
            send_keys = [k for k, m in part if m.send]
            key = min(recv_keys) if recv_keys else max(send_keys)
            if out:  # calls keep their order on both sides
                key = max(key, out[-1][0])
            late = [m for k, m in part if m.send and k > key] if recv_keys else []
            if recv_keys and key > min(recv_keys) or late:
                raise IssueOrderError(
                    f"{pair}: the {side} side would have to post {list(msgs)} together, but it needs a "
                    f"receive before a send of that call exists; no deadlock-free order of the stages' "
                    f"point-to-point traffic (a zebra wave order bug)")
            out.append((key, PipeCall(msgs[0].peer, msgs)))
    return out_a, out_b


def _ring_order(calls: list[list[tuple[float, PipeCall]]], peers: list[list[int]]) -> list[list[int]]:
    """The order in which each stage of a ring posts its calls (indices into `calls[s]`, a pair's
    calls in their order, `peers[s][k]` the stage of call k): by key, and among a stage's calls
    of one key (posted at one place of its list) in an order that lets every call go once both
    its stages reached it (NCCL's one queue per rank). Found by posting any call both of whose
    stages have it at hand: posting one never holds up another, so this finds an order whenever
    one exists; IssueOrderError when none does."""
    P = len(calls)
    pair_of: list[list[tuple[int, int]]] = [[] for _ in range(P)]  # (pair id, index in the pair) per call
    seen: dict[frozenset, int] = {}
    for s in range(P):
        count: dict[int, int] = {}
        for k in range(len(calls[s])):
            pid = seen.setdefault(frozenset((s, peers[s][k])), len(seen))
            pair_of[s].append((pid, count.get(pid, 0)))
            count[pid] = count.get(pid, 0) + 1
    keys = [sorted({kc[0] for kc in c}) for c in calls]
    group = [0] * P  # the key each stage has reached
    done_in_pair = [0] * len(seen)
    order: list[list[int]] = [[] for _ in range(P)]
    posted = [set() for _ in range(P)]

    def at_hand(s: int) -> dict[tuple[int, int], int]:
        if group[s] == len(keys[s]):
            return {}
        key = keys[s][group[s]]
        return {pair_of[s][k]: k for k, kc in enumerate(calls[s]) if kc[0] == key and k not in posted[s]}

    moved = True
    while moved:
        moved = False
        for s in range(P):
            for pk, k in at_hand(s).items():
                t = peers[s][k]
                other = at_hand(t)
                if pk[1] == done_in_pair[pk[0]] and pk in other:
                    for stage, i in ((s, k), (t, other[pk])):
                        order[stage].append(i)
                        posted[stage].add(i)
                    done_in_pair[pk[0]] += 1
                    moved = True
            for st in range(P):  # a stage whose calls of one key all went goes on to the next key
                while group[st] < len(keys[st]) and not at_hand(st):
                    group[st] += 1
    stuck = {s: [calls[s][k][1] for k in at_hand(s).values()] for s in range(P) if group[s] < len(keys[s])}
    if stuck:
        raise IssueOrderError(f"the pipeline stages' calls wait in a cycle: stage(s) wait at {stuck}; no deadlock-free "
                              f"order of the stages' point-to-point traffic (a zebra wave order bug)")
    return order


def _ring_calls(msgs: list[list[tuple[float, PipeMessage]]], tasks: list[list[Task]], num_layers: list[Layers]
                ) -> tuple[list[list[tuple[float, PipeCall]]], list[list[int]]]:
    """The calls of pipeline stages that form a ring (virtual stages: stage P - 1 sends on to stage
    0), with the stage each call is with. A receive left at its consumer can close a cycle of
    stages each waiting to send, so the calls follow the pipeline's data flow in rounds instead
    (as Megatron's interleaved schedule posts a step's sends with the next step's receives): a
    zero-time run of the stages' attention tasks, one per stage and round, each waiting for its
    input from an earlier round; after round r each pair of neighbours exchanges, in one call,
    the messages either made in round r. A sender is then past its producer and a receiver before
    its consumer, and every stage reaches round r's calls once round r - 1's went, so the calls
    of one round are the only ones that can wait on each other (_ring_order orders them)."""
    P = len(msgs)
    made: dict[PipeTask, int] = {}  # message -> the round its sender produced it
    heads = [[t for t in tasks[s] if t.kind in ATTENTION_KINDS] for s in range(P)]
    pos, at = [0] * P, [[] for _ in range(P)]  # at[s][r]: stage s's place after round r (after its A task pos - 1)
    while any(pos[s] < len(heads[s]) for s in range(P)):
        rnd, moved = len(at[0]), False
        for s in range(P):
            if pos[s] < len(heads[s]):
                recv, send = stage_transfers(heads[s][pos[s]], s, P, num_layers[s])
                if recv is None or made.get(recv, rnd) < rnd:
                    if send is not None:
                        made[send] = rnd
                    pos[s] += 1
                    moved = True
            at[s].append(pos[s] - 0.5)
        if not moved:
            raise IssueOrderError(f"pipeline stages wait for each other's inputs: stage heads "
                                  f"{[heads[s][pos[s]] if pos[s] < len(heads[s]) else None for s in range(P)]}")
    pairs = [(0, 1, msgs[0], msgs[1])] if P == 2 else [
        (s, (s + 1) % P, [m for m in msgs[s] if m[1].peer == 1], [m for m in msgs[(s + 1) % P] if m[1].peer == -1])
        for s in range(P)]
    calls: list[list[tuple[float, PipeCall]]] = [[] for _ in range(P)]
    peers: list[list[int]] = [[] for _ in range(P)]
    for s, t, a, b in pairs:
        if sorted(_message_key(m.task) for _, m in a) != sorted(_message_key(m.task) for _, m in b):
            raise IssueOrderError(f"pipeline stages {s} and {t} do not exchange the same messages: "
                                  f"{[m for _, m in a]} vs {[m for _, m in b]}")
        for stage, peer, side in ((s, t, a), (t, s, b)):
            rounds: dict[int, list[PipeMessage]] = {}
            for _, m in side:
                rounds.setdefault(made[m.task], []).append(m)
            for r in sorted(rounds):
                part = tuple(sorted(rounds[r], key=lambda m: _message_key(m.task)))
                calls[stage].append((at[stage][r], PipeCall(part[0].peer, part)))
                peers[stage].append(peer)
    return calls, peers


def pipe_calls(stage_tasks: list[list[Task]], num_layers: list[Layers]) -> list[list[tuple[float, PipeCall]]]:
    """Each stage's pipeline calls with their keys (stage_messages), in issue order;
    `stage_tasks[s]`: an attention rank's list of stage s, `num_layers[s]` its MoE layers (per
    model chunk with virtual stages: then stage P - 1 sends on to stage 0, a ring: _ring_calls)."""
    P = len(stage_tasks)
    msgs = [stage_messages(stage_tasks[s], s, P, num_layers[s]) for s in range(P)]
    if len(chunk_counts(num_layers[0])) > 1:
        calls, peers = _ring_calls(msgs, stage_tasks, num_layers)
        order = _ring_order(calls, peers)  # an order of each stage's calls that no cycle of waits holds up
        return [[calls[s][i] for i in o] for s, o in enumerate(order)]
    calls: list[list[tuple[float, PipeCall]]] = [[] for _ in range(P)]
    for s in range(P - 1):
        up, low = _calls_of_pair(msgs[s], msgs[s + 1], s)
        calls[s] += up
        calls[s + 1] += low
    # A stage's calls with its two neighbours: by key, the previous stage's first at a tie.
    return [sorted(c, key=lambda kc: (kc[0], kc[1].peer)) for c in calls]


@dataclass
class _Member:
    """One class of a stage's members (ranks whose task lists are equal): its program (tasks and
    pipeline calls in list order) and the sequence the simulation gives it."""
    attention: bool
    program: list
    pos: int = 0
    sequence: list = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.sequence = []

    def head(self):
        return self.program[self.pos] if self.pos < len(self.program) else None


def _program(tasks: list[Task], calls: list[tuple[float, PipeCall]]) -> list:
    """An attention rank's list with its pipeline calls placed: a call of key a + 0.5 right after
    the list's a-th A task (key -0.5: before the first)."""
    out: list = [c for k, c in calls if k == -0.5]
    a = -1
    for t in tasks:
        out.append(t)
        if t.kind in ATTENTION_KINDS:
            a += 1
            out += [c for k, c in calls if k == a + 0.5]
    return out


class _StageSim:
    """The zero-time simulation of one ZP group (one pipeline stage of it): members advance one
    compute task per round; a collective is issued in the round every member reached it, in the
    order they became ready; A tasks and pipeline calls run jointly on the attention members."""

    def __init__(self, members: list[_Member]):
        self.members = members
        self.attention = [m for m in members if m.attention]
        self.reached: dict[object, int] = {}  # collective -> members that reached it
        self.ready_at: dict[object, int] = {}  # collective -> round it became ready
        self.issued: dict[object, int] = {}  # collective -> round issued
        self.order: list = []
        self.place: dict[object, tuple] = {}  # collective -> where the first member's list reaches it

    def _reach(self, m: _Member) -> bool:
        moved = False
        while isinstance(m.head(), Task) and m.head().is_comm:
            t = m.head()
            ops = [Counts(t.layer, t.microbatch), t] if t.kind == TaskKind.D_F else [t]
            for op in ops:
                self.reached[op] = self.reached.get(op, 0) + 1
                if m is self.members[0]:  # ties go in a list's order (each communicator's FIFO)
                    self.place[op] = (m.pos, isinstance(op, Task))
            m.pos += 1
            moved = True
        return moved

    def _can_run(self, t: Task, L: Layers) -> bool:
        need = inputs(t, L)
        return need is None or need in self.issued

    def run(self, num_layers: Layers) -> None:
        L, n, rnd = num_layers, len(self.members), 0
        while any(m.head() is not None for m in self.members):
            moved = False
            for m in self.members:
                moved |= self._reach(m)
            # Joint attention events: every attention member at the same A task or call.
            heads = {repr(m.head()) for m in self.attention}
            h = self.attention[0].head() if self.attention else None
            joint = h is not None and (isinstance(h, PipeCall) or h.kind in ATTENTION_KINDS)
            if joint and len(heads) == 1 and (isinstance(h, PipeCall) or self._can_run(h, L)):
                for m in self.attention:
                    m.sequence.append(h)
                    m.pos += 1
                moved = True
            for m in self.members:  # a member's own compute (X_*, E_*), one per round
                h = m.head()
                if isinstance(h, Task) and not h.is_comm and h.kind not in ATTENTION_KINDS and self._can_run(h, L):
                    m.sequence.append(h)
                    m.pos += 1
                    moved = True
            for m in self.members:
                moved |= self._reach(m)
            ready = [op for op, c in self.reached.items() if c == n and op not in self.issued]
            for op in ready:
                self.ready_at.setdefault(op, rnd)
            # A D_F's payload goes a round after its counts (the host enqueues compute meanwhile),
            # unless nothing else can move.
            lagged = [op for op in ready if isinstance(op, Task) and op.kind == TaskKind.D_F
                      and self.issued.get(Counts(op.layer, op.microbatch), rnd) >= rnd]
            go = [op for op in ready if op not in lagged and not self._payload_before_counts(op)]
            if not go and not moved:
                go = [op for op in lagged if Counts(op.layer, op.microbatch) in self.issued]
            for op in sorted(go, key=lambda o: (self.ready_at[o], self.place[o])):
                self.issued[op] = rnd
                self.order.append(op)
                for m in self.members:
                    m.sequence.append(op)
                moved = True
            if not moved:
                stuck = {repr(m.head()) for m in self.members if m.head() is not None}
                raise IssueOrderError(f"zebra task lists deadlock: members wait at {sorted(stuck)} with "
                                      f"{[op for op, c in self.reached.items() if c < n and op not in self.issued]} "
                                      f"reached by only some members")
            rnd += 1

    def _payload_before_counts(self, op) -> bool:
        return isinstance(op, Task) and op.kind == TaskKind.D_F and Counts(op.layer, op.microbatch) not in self.issued


def stage_sequences(lists: dict[int, list[Task]], attention: set[int], calls: list[tuple[float, PipeCall]],
                    num_layers: Layers) -> dict[int, list[Issue]]:
    """The issue sequence of every member of one ZP group's stage: `lists` rank -> its task list,
    `attention` the attention ranks among them, `calls` the stage's pipeline calls (pipe_calls;
    empty without pipeline stages), `num_layers` the stage's MoE layers (per model chunk)."""
    classes: dict[tuple, _Member] = {}
    of: dict[int, _Member] = {}
    for r in sorted(lists):
        key = (r in attention, tuple(lists[r]))
        if key not in classes:
            prog = _program(lists[r], calls) if r in attention else list(lists[r])
            classes[key] = _Member(r in attention, prog)
        of[r] = classes[key]
    _StageSim(list(classes.values())).run(num_layers)
    return {r: m.sequence for r, m in of.items()}


def issue_sequence(plan, rank: int, num_microbatches: int | None = None, schedule: str | None = None) -> list[Issue]:
    """`rank`'s issue sequence (module docstring) under `plan` (a HeteroPlan) for `schedule`'s task
    lists (default the plan's), over `num_microbatches` (default the plan's R)."""
    from megatron_hetermoe.plan.tasks import schedule as schedule_named

    tasks_of = schedule_named(schedule or plan.schedule).tasks
    R = num_microbatches or plan.num_microbatches
    g, stage, P = plan.group_of(rank), plan.stage_of(rank), plan.pipeline_stages
    # The stage's attention members' calls shape every member's sequence (the same in every group).
    calls = stage_pipe_calls(plan, stage, R, schedule) if P > 1 else []
    members = plan.stage_members(g, stage)
    attention = set(plan.stage_ranks(g, stage)[0])
    lists = {r: tasks_of(plan, r, R) for r in members}
    return stage_sequences(lists, attention, calls, task_layers(plan, stage))[rank]


def stage_pipe_calls(plan, stage: int, num_microbatches: int | None = None,
                     schedule: str | None = None) -> list[tuple[float, PipeCall]]:
    """Pipeline stage `stage`'s calls with their keys (pipe_calls), as issue_sequence places them."""
    from megatron_hetermoe.plan.tasks import schedule as schedule_named

    tasks_of = schedule_named(schedule or plan.schedule).tasks
    R = num_microbatches or plan.num_microbatches
    firsts = [plan.stage_ranks(0, s)[0][0] for s in range(plan.pipeline_stages)]
    return pipe_calls([tasks_of(plan, r, R) for r in firsts],
                      [task_layers(plan, s) for s in range(plan.pipeline_stages)])[stage]
